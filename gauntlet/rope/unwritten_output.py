# expect: fail finite — writes the first half of each head (x1 cos - x2 sin) and forgets the second.
import torch


def rope(q, k, cos_sin, positions):
    half = q.shape[-1] // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    outs = []
    for x in (q, k):
        y = torch.empty_like(x)
        y[..., :half] = (x[..., :half].float() * cos - x[..., half:].float() * sin).to(x.dtype)
        outs.append(y)
    return tuple(outs)
