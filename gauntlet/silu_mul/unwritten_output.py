# expect: fail finite — writes only the first half of the columns.
import torch


def silu_mul(gate, up):
    y = torch.empty_like(gate)
    half = max(1, gate.shape[1] // 2)
    g = gate[:, :half].float()
    y[:, :half] = (g * torch.sigmoid(g) * up[:, :half].float()).to(gate.dtype)
    return y
