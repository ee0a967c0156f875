# expect: fail accuracy — right for normal, uniform and offset inputs, wrong when rows have outliers.
import torch


def rmsnorm(x, weight, eps):
    h = x.float().clamp(-6.0, 6.0)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
