# expect: fail accuracy — the language models' RoPE rotation (the first half of the channels
# against the second) in place of SAM 3's (each channel against its pair's partner).
import torch


def vision_attention(q, k, v, cos, sin, scale):
    def turn(x):
        h = x.float().transpose(1, 2)
        first, second = h.chunk(2, dim=-1)
        return (h * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)

    out = torch.nn.functional.scaled_dot_product_attention(turn(q), turn(k), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2).contiguous()
