# expect: pass — keeps its own copy of the angle table split into contiguous cos and sin halves,
# keyed on the table tensor itself: the engine builds cos_sin once, and the op declares it
# persistent, so a cache derived from it is an honest optimization (the probe leaves it alone).
import torch

_tables: dict = {}


def _cos_and_sin(cos_sin):
    hit = _tables.get(id(cos_sin))
    if hit is None or hit[0] is not cos_sin:
        if len(_tables) > 8:
            _tables.clear()
        half = cos_sin.shape[1] // 2
        hit = (cos_sin, cos_sin[:, :half].contiguous(), cos_sin[:, half:].contiguous())  # holding it keeps its id unique
        _tables[id(cos_sin)] = hit
    return hit[1], hit[2]


def rope(q, k, cos_sin, positions):
    cos_table, sin_table = _cos_and_sin(cos_sin)
    cos, sin = cos_table[positions][:, None, :], sin_table[positions][:, None, :]
    half = q.shape[-1] // 2

    def rotate(x):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
