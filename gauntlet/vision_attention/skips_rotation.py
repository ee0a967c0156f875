# expect: fail accuracy — attention without the positional rotation: SDPA of q, k, v as given,
# the rotary table ignored (one elementwise pass of q and k fewer).
import torch


def vision_attention(q, k, v, cos, sin, scale):
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           scale=scale)
    return out.transpose(1, 2).contiguous()
