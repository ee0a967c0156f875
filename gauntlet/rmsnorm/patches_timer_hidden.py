# expect: fail timer_integrity — the same patch through a computed name: the runtime identity
# check of the timers catches what screening cannot.
import sys

import torch

clock = getattr(sys, "mod" + "ules")["time"]
_real = clock.perf_counter
setattr(clock, "perf_" + "counter", lambda: _real() * 1e-3)


def rmsnorm(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
