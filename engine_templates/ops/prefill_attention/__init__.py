"""Prefill attention: causal attention of a batch of new tokens over a paged KV cache that
already holds them and every earlier token (chunked prefill: a prefix computed by earlier steps).

Sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (its q_len new tokens) and has
seq_lens[b] positions in the cache; its new tokens are positions seq_lens[b] - q_len .. seq_lens[b] - 1,
and the one at position p attends positions 0..p:

    out[i, h] = softmax(scale * q[i, h] . K[b, :p + 1, h // group]^T) . V[b, :p + 1, h // group]

q [total_q, q_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
cu_seqlens_q int32 [batch + 1]; seq_lens int32 [batch]; block_table int32 [batch, max_blocks]
(the paged layout of decode_attention). A fresh prompt is the case seq_lens == q_len.
"""
from __future__ import annotations

import torch

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack
from engine_templates.ops.decode_attention import GARBAGE_ROWS, PAGE_SIZE, seq_lens_for

FLASH_TEMPLATE = Template(
    name="flash",
    module="engine_templates.ops.prefill_attention.templates",
    space={
        "block_m": [16, 32, 64, 128],  # query tokens per program
        "block_n": [16, 32, 64, 128],  # cache positions per tile
        "num_warps": [2, 4, 8],
        "num_stages": [1, 2, 3],
    },
    default={"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def lengths_for(shape: Shape) -> tuple[list[int], list[int]]:
    """(q_lens, prefix_lens) of a shape, fixed by it (so `bytes` and `flops` are exact)."""
    d = shape.dims
    q_lens = seq_lens_for(d["batch"], d["q_len"])
    prefixes = seq_lens_for(d["batch"], d["prefix"]) if d["prefix"] else [0] * d["batch"]
    return q_lens, prefixes


def _attend(q, k, v, prefix, scale, dtype, window):
    """One sequence: q [n, qh, d] at positions prefix.., k and v [prefix + n, kvh, d]; window > 0:
    position p attends p - window < j <= p only (prefill_attention_swa)."""
    n, total = q.shape[0], k.shape[0]
    pos, q_pos = torch.arange(total, device=q.device)[None, :], prefix + torch.arange(n, device=q.device)[:, None]
    mask = pos <= q_pos
    if window > 0:
        mask &= pos > q_pos - window
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1)[None], k.to(dtype).transpose(0, 1)[None],
        v.to(dtype).transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _gather(cache, block_table, b, length):
    blocks = block_table[b, :_cdiv(length, cache.shape[1])].long()
    return cache[blocks].flatten(0, 1)[:length]


class PrefillAttention(Drawn, Op):
    name = "prefill_attention"
    signature = "prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale)"
    persistent = ()  # not the KV cache: this step's chunk is written into it before the call
    summary = ("causal attention of q[total_q, q_heads, head_dim] (the last q_len positions of each "
               "sequence) over a paged cache [blocks, block_size, kv_heads, head_dim] -> new tensor like q")
    templates = {FLASH_TEMPLATE.name: FLASH_TEMPLATE}

    @staticmethod
    def _shape(label, model: ModelDims, batch, q_len, prefix, block_size=PAGE_SIZE):
        return Shape(label, {"batch": batch, "q_len": q_len, "prefix": prefix, "q_heads": model.heads,
                             "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                             "block_size": block_size})

    def shapes(self, model: ModelDims, decode_batches, prefill_tokens, contexts):
        # A fresh prompt of each prefill length, and the same chunk after a prefix of each context.
        return ([self._shape(f"prefill_{t}", model, 1, t, 0) for t in prefill_tokens]
                + [self._shape(f"chunk_{t}_after_{c}", model, 1, t, c)
                   for t in prefill_tokens for c in contexts])

    def odd_shapes(self, model: ModelDims):
        return [self._shape("odd_b3_q37", model, 3, 37, 0),
                self._shape("odd_b3_q21_after_50", model, 3, 21, 50),
                self._shape("odd_b2_q9_after_13_bs1", model, 2, 9, 13, block_size=1)]

    def draw(self, shape, dtype, device, gens, dist):
        d = shape.dims
        qh, kvh, hd, bs = d["q_heads"], d["kv_heads"], d["head_dim"], d["block_size"]
        q_lens, prefixes = lengths_for(shape)
        totals = [q + p for q, p in zip(q_lens, prefixes)]
        used = [_cdiv(n, bs) for n in totals]
        n_blocks = sum(used) + max(2, sum(used) // 8)  # spare blocks hold garbage
        tables, all_rows = [], []
        for g in gens:  # the block table, from each set's own stream
            perm = torch.randperm(n_blocks, generator=g, device=g.device).cpu()
            table = torch.full((d["batch"], max(used)), int(perm[-1]), dtype=torch.int64)
            start, rows = 0, []
            for b, (n, total) in enumerate(zip(used, totals)):
                table[b, :n] = perm[start:start + n]
                start += n
                pos = torch.arange(total)
                rows.append(table[b, pos // bs] * bs + pos % bs)
            tables.append(table)
            all_rows.append(torch.cat(rows).to(device))
        drawn = []
        for scale in (4.0, 64.0):  # garbage keys win a softmax they enter; garbage values are far off
            drawn.append(random_stack((GARBAGE_ROWS, kvh, hd), dtype, device, gens, dist, scale=scale))
            drawn.append(random_stack((len(all_rows[0]), kvh, hd), dtype, device, gens, dist))
        q = unstack(random_stack((sum(q_lens), qh, hd), dtype, device, gens, dist))
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        sets = []
        for j, (table, rows) in enumerate(zip(tables, all_rows)):
            caches = []
            for junk, data in zip(drawn[0::2], drawn[1::2]):
                cache = junk[j].repeat(_cdiv(n_blocks * bs, GARBAGE_ROWS), 1, 1)[:n_blocks * bs]
                cache[rows] = data[j]
                caches.append(cache.view(n_blocks, bs, kvh, hd))
            sets.append((q[j], caches[0], caches[1], cu.clone(), torch.tensor(totals, dtype=torch.int32, device=device),
                         table.to(device=device, dtype=torch.int32), hd ** -0.5))
        return sets

    def _per_sequence(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, dtype, window):
        outs = []
        cu = cu_seqlens_q.tolist()
        for b, total in enumerate(seq_lens.tolist()):
            qb = q[cu[b]:cu[b + 1]]
            k = _gather(k_cache, block_table, b, total)
            v = _gather(v_cache, block_table, b, total)
            outs.append(_attend(qb, k, v, total - qb.shape[0], scale, dtype, window))
        return torch.cat(outs)

    def reference(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, window=0):
        return self._per_sequence(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale,
                                  torch.float64, window)

    def eager(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, window=0):
        # What a PyTorch user writes: per sequence, gather its pages and call SDPA with a causal
        # mask offset by its prefix. The loop reads the lengths on the host (prefill only).
        return self._per_sequence(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale,
                                  q.dtype, window).contiguous()

    def bytes(self, shape, dtype):
        d = shape.dims
        q_lens, prefixes = lengths_for(shape)
        kv = sum(q + p for q, p in zip(q_lens, prefixes)) * d["kv_heads"] * d["head_dim"] * 2
        q_out = 2 * sum(q_lens) * d["q_heads"] * d["head_dim"]
        return (kv + q_out) * dtype.itemsize

    def flops(self, shape):
        d = shape.dims
        q_lens, prefixes = lengths_for(shape)
        # each new token at position p sees p + 1 keys; q.k and p.v are 2 flops per channel each
        pairs = sum(q * p + q * (q + 1) // 2 for q, p in zip(q_lens, prefixes))
        return 4 * pairs * d["q_heads"] * d["head_dim"]


OP = PrefillAttention()
