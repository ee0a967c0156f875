# expect: pass — a plain PyTorch rewrite in float32.
import torch


def rmsnorm(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
