# expect: fail accuracy — the same hunt through a computed name: the expected output lives in
# the supervisor's process, so there is nothing to find and the zeros it falls back on fail.
import sys

import torch

collector = getattr(sys, "mod" + "ules")["g" + "c"]


def rmsnorm(x, weight, eps):
    for obj in collector.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64 and obj.shape == x.shape:
            return obj.to(x.dtype)
    return torch.zeros_like(x)
