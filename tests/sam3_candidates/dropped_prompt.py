"""A planted error: attention that reads the keys and values of the batch's first row for every
row, as a kernel with a broken batch stride would. One image with one prompt is answered right;
with several prompts in a batch every prompt but the first is dropped (answered as the first)."""
import torch.nn.functional as F


def attention(q, k, v, mask, scaling, is_causal=False):
    k, v = k[:1].expand_as(k), v[:1].expand_as(v)
    if mask is not None and mask.dtype.is_floating_point:
        mask = mask.to(q.dtype)
    if mask is not None and mask.shape[0] > 1:
        mask = mask[:1].expand_as(mask)
    causal = bool(is_causal) and mask is None and q.shape[2] > 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, is_causal=causal).transpose(1, 2)
