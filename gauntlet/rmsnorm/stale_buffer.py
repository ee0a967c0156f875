# expect: fail accuracy — computes once per shape, then returns the same buffer (the "100x" kernel).
import torch

_buffers = {}


def rmsnorm(x, weight, eps):
    key = (tuple(x.shape), x.dtype)
    if key not in _buffers:
        h = x.float()
        _buffers[key] = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return _buffers[key]
