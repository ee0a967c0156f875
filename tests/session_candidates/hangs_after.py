# Honest for its first HANG_AFTER calls (set by the test), then never returns: a hang in whichever
# stage makes that call. Its calls are counted in the `math` module, not its own: each stage
# imports the candidate afresh, while the process, the one sandbox of its stages, stays.
import math

import torch

HANG_AFTER = 0


def rmsnorm(x, weight, eps):
    calls = vars(math)["_calls"] = vars(math).get("_calls", 0) + 1
    if calls > HANG_AFTER:
        while True:
            pass
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
