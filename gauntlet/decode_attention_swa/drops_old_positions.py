# expect: fail inputs_unchanged — zeroes each sequence's cache rows before its window ("freeing"
# positions no query will see again): right answer, but the KV cache is the engine's, and
# dropping blocks is its allocator's decision, not a kernel's.
import torch


def _rows(cache, block_table, b, n):
    if block_table is None:
        return cache[b, :n]
    size = cache.shape[1]
    return cache[block_table[b, :(n + size - 1) // size].long()].flatten(0, 1)[:n]


def decode_attention_swa(q, k_cache, v_cache, seq_lens, block_table, scale, window):
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        first = max(0, n - window)
        for pos in range(first):
            if block_table is None:
                k_cache[b, pos] = 0
                v_cache[b, pos] = 0
            else:
                size = k_cache.shape[1]
                k_cache[int(block_table[b, pos // size]), pos % size] = 0
                v_cache[int(block_table[b, pos // size]), pos % size] = 0
        k = _rows(k_cache, block_table, b, n)[first:].float()
        v = _rows(v_cache, block_table, b, n)[first:].float()
        qg = q[b].float().view(kv_heads, q_heads // kv_heads, head_dim)
        p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k) * scale, dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(q_heads, head_dim).to(q.dtype)
    return out
