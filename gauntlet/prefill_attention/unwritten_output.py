# expect: fail finite — attends for the first half of the query heads only; the rest of the
# output is whatever the allocation held.
import torch


def _attend(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, out):
    size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_table[b, :(n + size - 1) // size].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float()
        v = v_cache[blocks].flatten(0, 1)[:n].float()
        qb = q[cu[b]:cu[b + 1]].float()
        m = qb.shape[0]
        s = torch.einsum("mkgd,nkd->kgmn", qb.reshape(m, kv_heads, group, head_dim), k) * scale
        # the new tokens are the last m positions; the one at position p sees 0..p
        seen = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None]
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
        out[cu[b]:cu[b + 1]] = torch.einsum("kgmn,nkd->mkgd", p, v).reshape(m, -1, head_dim).to(out.dtype)
    return out


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale):
    done = max(1, k_cache.shape[2] // 2)  # kv heads, and with them their groups of q heads
    heads = done * (q.shape[1] // k_cache.shape[2])
    out = torch.empty_like(q)
    out[:, :heads] = _attend(q[:, :heads], k_cache[:, :, :done], v_cache[:, :, :done], cu_seqlens_q, seq_lens,
                             block_table, scale, torch.empty_like(q[:, :heads]))
    return out
