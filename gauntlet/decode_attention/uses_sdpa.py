# expect: pass, flagged reference_fallback — PyTorch's own scaled_dot_product_attention over the
# gathered pages: correct, but its speed is torch's, so the score counts as no speed-up.
import torch


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    if block_table is not None:
        k_cache, v_cache = k_cache[block_table].flatten(1, 2), v_cache[block_table].flatten(1, 2)
    mask = torch.arange(k_cache.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=mask[:, None, None, :],
        scale=scale, enable_gqa=True)
    return out.squeeze(2).contiguous()
