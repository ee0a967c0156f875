# expect: pass — the rotary turn written out (pairs of channels) in float32, then SDPA per head.
import torch


def vision_attention(q, k, v, cos, sin, scale):
    def turn(x):
        h = x.float().transpose(1, 2)
        pairs = h.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return (h * cos + rotated * sin).to(x.dtype)

    out = torch.nn.functional.scaled_dot_product_attention(turn(q), turn(k), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2).contiguous()
