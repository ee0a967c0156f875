# expect: fail screen — looks for the expected output among the process's objects.
import gc

import torch


def rmsnorm(x, weight, eps):
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64 and obj.shape == x.shape:
            return obj.to(x.dtype)
    return torch.zeros_like(x)
