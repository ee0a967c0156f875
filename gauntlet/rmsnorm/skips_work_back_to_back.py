# expect: fail timed_outputs — a timing calls it back to back, a judged call comes after the harness
# drew inputs and checked the last output: it returns an uninitialized tensor when it is called
# within 15 us of its last return.
import time

import torch

_last = [0.0]


def rmsnorm(x, weight, eps):
    if time.perf_counter() - _last[0] < 15e-6:
        out = torch.empty_like(x)
    else:
        h = x.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    _last[0] = time.perf_counter()
    return out
