# expect: fail accuracy (flagged reduced_precision) — squeezes the activations through fp8.
import torch


def rmsnorm(x, weight, eps):
    h = x.to(torch.float8_e4m3fn).float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
