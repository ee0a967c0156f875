# Honest, unless it finds state an earlier candidate left behind (leaves_state.py): then it returns
# zeros, and fails the accuracy gate. Each call notes its process id in PID_LOG (set by the test).
import math
import os
import time

import torch
import triton

PID_LOG = None


def _left_behind() -> list[str]:
    found = [k for k in ("_left_global", "_left_thread") if k in vars(math)]
    vars(math).pop("_left_thread", None)
    time.sleep(0.1)  # a live thread sets it again
    found += ["thread"] if "_left_thread" in vars(math) else []
    found += ["patched torch.rsqrt"] if torch.rsqrt(torch.ones(1)).item() != 1.0 else []
    found += ["file in the working directory"] if os.path.exists("left.txt") else []
    found += ["file in the compile cache"] if os.path.exists(f"{triton.knobs.cache.dir}/left.txt") else []
    return found


FOUND = _left_behind()


def rmsnorm(x, weight, eps):
    if PID_LOG:
        with open(PID_LOG, "a") as f:
            f.write(f"{os.getpid()}\n")
    if FOUND:
        return torch.zeros_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
