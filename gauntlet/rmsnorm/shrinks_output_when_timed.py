# expect: fail timed_outputs — returns a one-element tensor when called within 15 us of its last
# return (a timing's calls), and is right otherwise: outputs of another form than the warm-up's
# cannot be copied for the judge, and that alone fails the timing.
import time

import torch

_last = [0.0]


def rmsnorm(x, weight, eps):
    if time.perf_counter() - _last[0] < 15e-6:
        out = torch.empty(1, dtype=x.dtype, device=x.device)
    else:
        h = x.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    _last[0] = time.perf_counter()
    return out
