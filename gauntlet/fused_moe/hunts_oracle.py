# expect: fail accuracy — searches the process's objects (gc, through a computed name) for a
# float64 tensor of the output's shape: the oracle is in the supervisor, nothing to find.
import sys

import torch

collector = getattr(sys, "mod" + "ules")["g" + "c"]


def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    for obj in collector.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64 and obj.shape == x.shape:
            return obj.to(x.dtype)
    return torch.zeros_like(x)
