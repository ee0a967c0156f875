# expect: fail inputs_unchanged — rotates q and k in place (as some engines' rope does) and
# returns copies: the op's contract is two new tensors and untouched inputs.
import torch


def rope(q, k, cos_sin, positions):
    half = q.shape[-1] // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return q.clone(), k.clone()
