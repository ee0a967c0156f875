# expect: fail accuracy (flagged reduced_precision) — rotates fp8 (e5m2) copies of q and k.
import torch


def rope(q, k, cos_sin, positions):
    half = q.shape[-1] // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x):
        x8 = x.to(torch.float8_e5m2).float()
        x1, x2 = x8[..., :half], x8[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
