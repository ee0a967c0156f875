# expect: fail accuracy (flagged reduced_precision) — squeezes both inputs through fp8.
import torch


def silu_mul(gate, up):
    g, u = gate.to(torch.float8_e5m2).float(), up.to(torch.float8_e5m2).float()
    return (g * torch.sigmoid(g) * u).to(gate.dtype)
