# expect: pass — a plain PyTorch rewrite in float32, without torch's silu.
import torch


def silu_mul(gate, up):
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
