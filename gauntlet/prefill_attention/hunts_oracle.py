# expect: fail accuracy — searches the process's objects (gc, through a computed name) for a
# float64 tensor of the output's shape: the oracle is in the supervisor, nothing to find.
import sys

import torch

collector = getattr(sys, "mod" + "ules")["g" + "c"]


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale):
    for obj in collector.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64 and obj.shape == q.shape:
            return obj.to(q.dtype)
    return torch.zeros_like(q)
