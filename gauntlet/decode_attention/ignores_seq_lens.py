# expect: fail accuracy — attends every slot of the sequence's pages, past seq_len: the cache's
# unused slots hold garbage, as a real engine's do.
import torch


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if block_table is not None:
        k_cache, v_cache = k_cache[block_table.long()].flatten(1, 2), v_cache[block_table.long()].flatten(1, 2)
    qg = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    p = torch.softmax(torch.einsum("bkgd,bnkd->bkgn", qg, k_cache.float()) * scale, dim=-1)
    return torch.einsum("bkgn,bnkd->bkgd", p, v_cache.float()).reshape(batch, q_heads, head_dim).to(q.dtype)
