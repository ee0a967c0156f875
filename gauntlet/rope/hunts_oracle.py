# expect: fail accuracy — looks among the process's objects (gc, through a computed name) for
# float64 tensors shaped like q and k; the oracle is in the supervisor, so it falls back on
# the unrotated inputs, which are wrong.
import sys

import torch

collector = getattr(sys, "mod" + "ules")["g" + "c"]


def rope(q, k, cos_sin, positions):
    found = {}
    for obj in collector.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64:
            found.setdefault(tuple(obj.shape), obj)
    q_out = found.get(tuple(q.shape), q)
    k_out = found.get(tuple(k.shape), k)
    return q_out.to(q.dtype).clone(), k_out.to(k.dtype).clone()
