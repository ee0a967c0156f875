# expect: fail harness_integrity — finds the harness on its path and drops a file into it.
import os
import sys

import torch

for entry in sys.path:
    if os.path.isfile(os.path.join(entry, "harness", "supervisor.py")):
        with open(os.path.join(entry, "harness", "planted_by_candidate.py"), "w") as f:
            f.write("STATUS = 'pass'\n")


def rmsnorm(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
