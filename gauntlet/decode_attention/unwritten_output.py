# expect: fail finite — attends for the first half of the query heads only; the rest of the
# output is whatever the allocation held.
import torch


def _rows(cache, block_table, b, n):
    if block_table is None:
        return cache[b, :n]
    size = cache.shape[1]
    return cache[block_table[b, :(n + size - 1) // size].long()].flatten(0, 1)[:n]


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group, done = q_heads // kv_heads, max(1, kv_heads // 2)
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        k = _rows(k_cache, block_table, b, n)[:, :done].float()
        v = _rows(v_cache, block_table, b, n)[:, :done].float()
        qg = q[b, :done * group].float().view(done, group, head_dim)
        p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k) * scale, dim=-1)
        out[b, :done * group] = torch.einsum("kgn,nkd->kgd", p, v).reshape(-1, head_dim).to(q.dtype)
    return out
