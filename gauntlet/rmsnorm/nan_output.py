# expect: fail finite — one NaN in an otherwise right output.
import torch


def rmsnorm(x, weight, eps):
    h = x.float()
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    y.view(-1)[-1] = float("nan")
    return y
