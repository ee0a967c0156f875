# expect: fail timer_integrity — replaces statistics.median (what timings are reduced with) while
# it is being timed, and puts the original back whenever it finds its input's values changed under
# the same pointer (a probe on refilled inputs, a check call on new ones), so that the swap is gone
# by the end of the stage. The harness reduces with a median it bound at import, and looks at the
# timers after every shape's timings.
import statistics

import torch

_stats = statistics
_real = statistics.median
_seen = {}


def _tenth(data):
    return _real(data) / 10


def rmsnorm(x, weight, eps):
    first = float(x.flatten()[0])
    timed = _seen.get(x.data_ptr()) == first  # values it has seen there: the timed loop's inputs
    _seen[x.data_ptr()] = first
    setattr(_stats, "median", _tenth if timed else _real)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
