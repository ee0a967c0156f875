# expect: fail screen — makes the clock run slow for everyone.
import time

import torch

_real = time.perf_counter
time.perf_counter = lambda: _real() * 1e-3


def rmsnorm(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
