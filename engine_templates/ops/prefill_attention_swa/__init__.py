"""Prefill attention with a sliding window (Mistral's `sliding_window`): prefill_attention where
the new token at position p attends positions p - window < j <= p only, as transformers' Mistral
masks them (each position sees itself and the window - 1 before it). Inputs, the paged layout
and the flash template are prefill_attention's; `window` is a dim of the shape, the model's own.
"""
from __future__ import annotations

from engine_templates.ops.decode_attention_swa import Windowed
from engine_templates.ops.prefill_attention import PrefillAttention, lengths_for


class PrefillAttentionSWA(Windowed, PrefillAttention):
    name = "prefill_attention_swa"
    signature = "prefill_attention_swa(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, window)"
    summary = ("prefill_attention where position p attends p - window < j <= p only (a sliding window) "
               "-> new tensor like q")

    def bytes(self, shape, dtype):
        d = shape.dims
        q_lens, prefixes = lengths_for(shape)
        # a sequence's keys from its first new token's window to its end
        kv = sum(q + p - max(0, p - d["window"] + 1) for q, p in zip(q_lens, prefixes))
        q_out = 2 * sum(q_lens) * d["q_heads"] * d["head_dim"]
        return (kv * d["kv_heads"] * d["head_dim"] * 2 + q_out) * dtype.itemsize

    def flops(self, shape):
        d, w = shape.dims, shape.dims["window"]
        q_lens, prefixes = lengths_for(shape)
        # the token at position p sees min(p + 1, window) keys
        pairs = sum(min(pos + 1, w) for q, p in zip(q_lens, prefixes) for pos in range(p, p + q))
        return 4 * pairs * d["q_heads"] * d["head_dim"]


OP = PrefillAttentionSWA()
