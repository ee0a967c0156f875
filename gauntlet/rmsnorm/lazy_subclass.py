# expect: fail output_form — returns a tensor subclass, which could compute only when inspected.
import torch


class Lazy(torch.Tensor):
    pass


def rmsnorm(x, weight, eps):
    h = x.float()
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y.as_subclass(Lazy)
