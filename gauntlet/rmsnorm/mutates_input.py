# expect: fail inputs_unchanged — a right answer, computed in place in the input.
import torch


def rmsnorm(x, weight, eps):
    h = x.float()
    x.copy_((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype))
    return x.clone()
