# expect: fail inputs_unchanged — turns q and k in place (saving two buffers), then attends.
import torch


def vision_attention(q, k, v, cos, sin, scale):
    for x in (q, k):
        h = x.float()
        pairs = h.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        x.copy_((h * cos[:, None] + rotated * sin[:, None]).to(x.dtype))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           scale=scale)
    return out.transpose(1, 2).contiguous()
