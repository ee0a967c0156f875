"""Decode attention: one query token per sequence against its KV cache, grouped-query heads,
variable sequence lengths in a batch, the cache either contiguous or paged.

    out[b, h] = softmax(scale * q[b, h] . K[b, :seq_lens[b], h // group]^T) . V[b, :seq_lens[b], h // group]

Contiguous layout: k_cache, v_cache [batch, max_len, kv_heads, head_dim], block_table None.
Paged layout: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim], block_table int32
[batch, max_blocks_per_seq]; position p of sequence b lives in block block_table[b, p // block_size]
at slot p % block_size. The layout is part of the shape (dims "paged", "block_size") so that both
are checked and timed.
"""
from __future__ import annotations

import torch

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack

SPLIT_KV_TEMPLATE = Template(
    name="split_kv",
    module="engine_templates.ops.decode_attention.templates",
    space={
        # programs per (sequence, kv head); 0: chosen per call, ~2 programs per SM (templates.auto_splits),
        # first so that the gauntlet's "far" point (every dimension's last value) is a fixed 32
        "num_splits": [0, 1, 2, 4, 8, 16, 32],
        "block_n": [16, 32, 64, 128],  # cache positions per tile
        "num_warps": [1, 2, 4, 8],
        "num_stages": [1, 2, 3, 4],
    },
    # On an H200 (qwen3-8b heads, bf16) the best fixed split count went from 32 (batch 1-8, 32k
    # context) to 4-8 (batch 32-128, 4k), and 16 splits left batch 1 at 27-52% of bandwidth
    # (2026-12-03): the default chooses the count per call (0), which suits both ends.
    default={"num_splits": 0, "block_n": 64, "num_warps": 4, "num_stages": 2},
)

PAGE_SIZE = 16  # vLLM's default block size
GARBAGE_ROWS = 61  # a prime, so the garbage pattern never lines up with blocks or tiles


def seq_lens_for(batch: int, context: int) -> list[int]:
    """The sequence lengths of a shape: the longest is `context`, the others uniform in [1, context],
    the second one odd. Fixed by the shape (only their order is drawn per call), so that `bytes`
    is the exact traffic of every call rather than an expectation."""
    gen = torch.Generator().manual_seed(1_000_003 * batch + context)
    lens = torch.randint(1, context + 1, (batch,), generator=gen).tolist()
    lens[0] = context
    if batch > 1 and lens[1] % 2 == 0:
        lens[1] -= 1
    return lens


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DecodeAttention(Drawn, Op):
    name = "decode_attention"
    signature = "decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale)"
    persistent = ()  # not the KV cache: new tokens' keys and values land in it every step
    summary = ("q[batch, q_heads, head_dim] against a KV cache of seq_lens[batch] positions "
               "(contiguous [batch, max_len, kv_heads, head_dim], or paged [blocks, block_size, "
               "kv_heads, head_dim] + block_table[batch, max_blocks]) -> new tensor like q")
    templates = {SPLIT_KV_TEMPLATE.name: SPLIT_KV_TEMPLATE}

    @staticmethod
    def _shape(label: str, model: ModelDims, batch: int, context: int, block_size: int) -> Shape:
        return Shape(label, {"batch": batch, "context": context, "q_heads": model.heads,
                             "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                             "paged": int(block_size > 0), "block_size": block_size})

    def shapes(self, model: ModelDims, decode_batches, prefill_tokens, contexts):
        # Both layouts for every (batch, context): 2 x |batches| x |contexts| shapes, 16 for the
        # default workload. Prefill lengths do not apply to decode.
        return [self._shape(f"b{b}_ctx{c}_{layout}", model, b, c, bs)
                for c in contexts for b in decode_batches
                for layout, bs in (("paged", PAGE_SIZE), ("contig", 0))]

    def odd_shapes(self, model: ModelDims):
        # Three sequences, a context that is no multiple of a block or a tile, and token-granular
        # pages (SGLang's layout), where a tile spans many blocks.
        return [self._shape("odd_b3_ctx333_paged", model, 3, 333, PAGE_SIZE),
                self._shape("odd_b3_ctx333_contig", model, 3, 333, 0),
                self._shape("odd_b5_ctx77_paged_bs1", model, 5, 77, 1)]

    def draw(self, shape, dtype, device, gens, dist):
        d = shape.dims
        b, ctx, qh, kvh, hd = d["batch"], d["context"], d["q_heads"], d["kv_heads"], d["head_dim"]
        lens = torch.tensor(seq_lens_for(b, ctx), dtype=torch.int64)
        # the longest sequence is not always first
        orders = [lens[torch.randperm(b, generator=g, device=g.device).cpu()] for g in gens]
        q = unstack(random_stack((b, qh, hd), dtype, device, gens, dist))
        k_valid = random_stack((int(lens.sum()), kvh, hd), dtype, device, gens, dist)
        v_valid = random_stack((int(lens.sum()), kvh, hd), dtype, device, gens, dist)
        # Every cache slot past a sequence's length holds large garbage: keys 4x the data (scores
        # that win the softmax) and values 64x, so a kernel that reads past seq_len is far off.
        k_junk = random_stack((GARBAGE_ROWS, kvh, hd), dtype, device, gens, dist, scale=4.0)
        v_junk = random_stack((GARBAGE_ROWS, kvh, hd), dtype, device, gens, dist, scale=64.0)
        return [self._assemble(shape, device, g, *a) for g, *a in zip(gens, orders, q, k_valid, v_valid, k_junk, v_junk)]

    def _assemble(self, shape, device, gen, lens, q, k_valid, v_valid, k_junk, v_junk) -> tuple:
        """One input set from its drawn tensors: the block table (drawn from `gen`'s own stream)
        and the caches, garbage past each sequence's length."""
        d = shape.dims
        b, ctx, kvh, hd = d["batch"], d["context"], d["kv_heads"], d["head_dim"]
        pos = torch.arange(ctx)
        valid = pos[None, :] < lens[:, None]  # [batch, ctx]: the slots that hold data
        if d["paged"]:
            bs = d["block_size"]
            max_blocks = _cdiv(ctx, bs)
            used = [_cdiv(n, bs) for n in lens.tolist()]
            n_used = sum(used)
            n_blocks = n_used + max(2, n_used // 8)  # spare blocks the allocator has not handed out
            perm = torch.randperm(n_blocks, generator=gen, device=gen.device).cpu()
            spare = perm[n_used:]
            # Table entries past a sequence's last block point at spare (garbage) blocks: a kernel
            # that follows them reads garbage instead of faulting, so the accuracy gate catches it.
            table = spare[torch.randint(len(spare), (b, max_blocks), generator=gen, device=gen.device).cpu()]
            start = 0
            for i, n in enumerate(used):
                table[i, :n] = perm[start:start + n]  # blocks in no particular order
                start += n
            rows = (table[:, pos // bs] * bs + pos % bs)[valid]  # flat cache row of each data slot
            n_rows = n_blocks * bs
            block_table = table.to(device=device, dtype=torch.int32)
        else:
            rows = (torch.arange(b)[:, None] * ctx + pos)[valid]
            n_rows = b * ctx
            block_table = None
        caches = []
        for junk, data in ((k_junk, k_valid), (v_junk, v_valid)):
            cache = junk.repeat(_cdiv(n_rows, GARBAGE_ROWS), 1, 1)[:n_rows]
            cache[rows.to(device)] = data
            caches.append(cache.view(-1, d["block_size"] or ctx, kvh, hd))
        seq_lens = lens.to(device=device, dtype=torch.int32)
        return q, caches[0], caches[1], seq_lens, block_table, hd ** -0.5

    def reference(self, q, k_cache, v_cache, seq_lens, block_table, scale, window=0):
        # window > 0: the last `window` positions of each sequence only (decode_attention_swa)
        b, qh, hd = q.shape
        kvh = k_cache.shape[2]
        out = torch.empty((b, qh, hd), dtype=torch.float64, device=q.device)
        for i, n in enumerate(seq_lens.tolist()):
            if block_table is None:
                k, v = k_cache[i, :n], v_cache[i, :n]
            else:
                blocks = block_table[i, :_cdiv(n, k_cache.shape[1])].long()
                k = k_cache[blocks].reshape(-1, kvh, hd)[:n]
                v = v_cache[blocks].reshape(-1, kvh, hd)[:n]
            if window > 0:
                k, v = k[max(0, n - window):], v[max(0, n - window):]
            qg = q[i].double().view(kvh, qh // kvh, hd)  # q head h belongs to kv head h // group
            s = torch.einsum("kgd,nkd->kgn", qg, k.double()) * scale
            out[i] = torch.einsum("kgn,nkd->kgd", torch.softmax(s, dim=-1), v.double()).reshape(qh, hd)
        return out

    def eager(self, q, k_cache, v_cache, seq_lens, block_table, scale, window=0):
        # What a PyTorch user writes: gather the pages into a padded batch, mask by length, SDPA.
        if block_table is None:
            k, v = k_cache, v_cache
        else:
            k = k_cache[block_table].flatten(1, 2)  # [batch, max_blocks * block_size, kv, dim]
            v = v_cache[block_table].flatten(1, 2)
        pos = torch.arange(k.shape[1], device=q.device)[None, :]
        mask = pos < seq_lens[:, None]
        if window > 0:
            mask &= pos >= seq_lens[:, None] - window
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
            scale=scale, enable_gqa=True)
        return out.squeeze(2)

    def bytes(self, shape, dtype):
        d = shape.dims
        lens = seq_lens_for(d["batch"], d["context"])
        kv = sum(lens) * d["kv_heads"] * d["head_dim"] * 2 * dtype.itemsize  # K and V up to seq_len
        q_out = 2 * d["batch"] * d["q_heads"] * d["head_dim"] * dtype.itemsize
        meta = 4 * d["batch"]  # seq_lens
        if d["paged"]:
            meta += 4 * sum(_cdiv(n, d["block_size"]) for n in lens)  # the table entries in use
        return kv + q_out + meta

    def flops(self, shape):
        d = shape.dims
        # q.k and p.v: 2 flops per multiply-add each, per position, q head and channel
        return 4 * sum(seq_lens_for(d["batch"], d["context"])) * d["q_heads"] * d["head_dim"]


OP = DecodeAttention()
