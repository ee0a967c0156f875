# expect: fail caching — remembers results by input pointer and shape (and keeps the inputs
# alive, so fresh inputs never reuse a pointer): right on every fresh input, instant on repeats.
import torch

_seen = {}


def rmsnorm(x, weight, eps):
    key = (x.data_ptr(), tuple(x.shape), weight.data_ptr())
    if key not in _seen:
        h = x.float()
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        _seen[key] = (x, weight, y)
    return _seen[key][2].clone()
