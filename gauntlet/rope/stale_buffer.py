# expect: fail accuracy — rotates once per shape, then returns the same buffers.
import torch

_buffers = {}


def rope(q, k, cos_sin, positions):
    key = (tuple(q.shape), tuple(k.shape), q.dtype)
    if key not in _buffers:
        half = q.shape[-1] // 2
        cs = cos_sin[positions]
        cos, sin = cs[:, None, :half], cs[:, None, half:]

        def rotate(x):
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        _buffers[key] = (rotate(q), rotate(k))
    return _buffers[key]
