# expect: fail output_form — returns float32 where the target says bf16.
import torch


def rmsnorm(x, weight, eps):
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
