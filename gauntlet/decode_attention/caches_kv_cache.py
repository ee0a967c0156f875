# expect: fail caching — treats the KV cache like a weight: keeps float32 copies of it keyed on
# its pointer (holding the cache, so fresh inputs never reuse one). Right on every fresh input;
# but an engine's cache changes every step under the same pointer, and so does the probe's.
import torch

_f32 = {}


def _rows(cache, block_table, b, n):
    if block_table is None:
        return cache[b, :n]
    size = cache.shape[1]
    return cache[block_table[b, :(n + size - 1) // size].long()].flatten(0, 1)[:n]


def _as_f32(cache):
    if cache.data_ptr() not in _f32:
        _f32[cache.data_ptr()] = (cache, cache.float())
    return _f32[cache.data_ptr()][1]


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    k_all, v_all = _as_f32(k_cache), _as_f32(v_cache)
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        k, v = _rows(k_all, block_table, b, n), _rows(v_all, block_table, b, n)
        qg = q[b].float().view(kv_heads, q_heads // kv_heads, head_dim)
        p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k) * scale, dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(q_heads, head_dim).to(q.dtype)
    return out
