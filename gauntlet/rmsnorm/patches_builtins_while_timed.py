# expect: fail timer_integrity — swaps the builtins module's `sorted` (what a median sorts with)
# for one that divides every figure by ten, reaching the module through `print.__self__` (no
# import to screen), only while it is timed, and puts it back whenever the harness probes it. The
# harness's timing binds its own builtins and median at import, and looks after every shape.
import torch

_builtins = print.__self__
_real = sorted


def _tenth(values):
    return [v / 10 for v in _real(values)]


def rmsnorm(x, weight, eps):
    setattr(_builtins, "sorted", _real if torch.are_deterministic_algorithms_enabled() else _tenth)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
