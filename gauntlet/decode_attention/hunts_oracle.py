# expect: fail accuracy — searches the process's objects (gc, through a computed name) for a
# float64 tensor of the output's shape: the oracle lives in the supervisor, so the zeros it falls
# back on are all it has.
import sys

import torch

collector = getattr(sys, "mod" + "ules")["g" + "c"]


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    for obj in collector.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64 and obj.shape == q.shape:
            return obj.to(q.dtype)
    return torch.zeros_like(q)
