# expect: fail caching — remembers results by input pointer and shape (and keeps the inputs alive,
# so fresh inputs never reuse a pointer): right on every fresh input, instant on repeats.
import torch

_seen = {}


def layernorm(x, weight, bias, eps):
    key = (x.data_ptr(), tuple(x.shape), weight.data_ptr(), bias.data_ptr())
    if key not in _seen:
        y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
        _seen[key] = (x, weight, bias, y.to(x.dtype))
    return _seen[key][3].clone()
