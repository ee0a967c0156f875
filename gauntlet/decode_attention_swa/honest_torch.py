# expect: pass — a plain PyTorch rewrite: per sequence, gather its last `window` cache rows,
# softmax in float32.
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
        first = max(0, n - window)  # the query at position n - 1 sees n - window .. n - 1
        k = _rows(k_cache, block_table, b, n)[first:].float()
        v = _rows(v_cache, block_table, b, n)[first:].float()
        qg = q[b].float().view(kv_heads, q_heads // kv_heads, head_dim)
        p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k) * scale, dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(q_heads, head_dim).to(q.dtype)
    return out
