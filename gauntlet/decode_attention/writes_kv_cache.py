# expect: fail inputs_unchanged — folds the softmax scale into the caller's key cache in place
# (one multiply saved per score) and attends with scale 1: right on this call, but the KV cache
# is the engine's, and the next step would read keys scaled twice.
import torch


def _rows(cache, block_table, b, n):
    if block_table is None:
        return cache[b, :n]
    size = cache.shape[1]
    return cache[block_table[b, :(n + size - 1) // size].long()].flatten(0, 1)[:n]


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    k_cache.mul_(scale)
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        k, v = _rows(k_cache, block_table, b, n).float(), _rows(v_cache, block_table, b, n).float()
        qg = q[b].float().view(kv_heads, q_heads // kv_heads, head_dim)
        p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k), dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(q_heads, head_dim).to(q.dtype)
    return out
