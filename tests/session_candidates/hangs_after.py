# Honest for its first HANG_AFTER calls (set by the test), then never returns: a hang in whichever
# stage makes that call, its calls counted across the stages of its one sandbox.
import torch

HANG_AFTER = 0
_calls = [0]


def rmsnorm(x, weight, eps):
    _calls[0] += 1
    if _calls[0] > HANG_AFTER:
        while True:
            pass
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
