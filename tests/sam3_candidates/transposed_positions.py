"""A planted error: the ViT attention with its 2-D rotary table read transposed (row for column),
as a kernel that indexes the (H, W) grid the wrong way round would. Square windows and images:
every shape still fits, only the positions are wrong."""
import math

import torch.nn.functional as F


def _rotate_pairs(x):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    import torch
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def vision_attention(q, k, v, cos, sin, scale):
    side = math.isqrt(cos.shape[0])
    cos = cos.reshape(side, side, -1).transpose(0, 1).reshape(cos.shape)[:, None]
    sin = sin.reshape(side, side, -1).transpose(0, 1).reshape(sin.shape)[:, None]
    qf, kf = q.float(), k.float()
    q = (qf * cos + _rotate_pairs(qf) * sin).to(v.dtype).transpose(1, 2)
    k = (kf * cos + _rotate_pairs(kf) * sin).to(v.dtype).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), scale=scale).transpose(1, 2)
