# expect: pass — a plain PyTorch rewrite: per sequence, gather its pages, mask causally and to the
# window (the token at position p sees p - window + 1 .. p), softmax in float32.
import torch


def prefill_attention_swa(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, window):
    size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_table[b, :(n + size - 1) // size].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float()
        v = v_cache[blocks].flatten(0, 1)[:n].float()
        qb = q[cu[b]:cu[b + 1]].float()
        m = qb.shape[0]
        s = torch.einsum("mkgd,nkd->kgmn", qb.reshape(m, kv_heads, group, head_dim), k) * scale
        key = torch.arange(n, device=q.device)[None, :]
        pos = torch.arange(n - m, n, device=q.device)[:, None]  # the new tokens are the last m
        seen = (key <= pos) & (key > pos - window)
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
        out[cu[b]:cu[b + 1]] = torch.einsum("kgmn,nkd->mkgd", p, v).reshape(m, -1, head_dim).to(q.dtype)
    return out
