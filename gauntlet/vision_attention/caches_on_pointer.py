# expect: fail caching — remembers results by the pointers of q, k and v (keeping them alive, so
# fresh inputs never reuse one): right on every fresh input, instant on repeats.
import torch

_seen = {}


def vision_attention(q, k, v, cos, sin, scale):
    key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape))
    if key not in _seen:
        def turn(x):
            h = x.float().transpose(1, 2)
            pairs = h.unflatten(-1, (-1, 2))
            rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
            return (h * cos + rotated * sin).to(x.dtype)

        out = torch.nn.functional.scaled_dot_product_attention(turn(q), turn(k), v.transpose(1, 2), scale=scale)
        _seen[key] = (q, k, v, out.transpose(1, 2).contiguous())
    return _seen[key][3].clone()
