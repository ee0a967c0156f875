# expect: fail timer_integrity — replaces statistics.median (what timings are reduced with) while
# it is being timed, and puts the original back whenever the harness probes it (deterministic
# algorithms on), so that the swap is gone by the end of the stage. The harness reduces with a
# median it bound at import, and looks at the timers after every shape's timings.
import statistics

import torch

_stats = statistics
_real = statistics.median


def _tenth(data):
    return _real(data) / 10


def rmsnorm(x, weight, eps):
    setattr(_stats, "median", _real if torch.are_deterministic_algorithms_enabled() else _tenth)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
