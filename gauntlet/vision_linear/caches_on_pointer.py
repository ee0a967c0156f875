# expect: fail caching — remembers results by the input's pointer and shape (keeping the input
# alive, so fresh inputs never reuse one): right on every fresh input, instant on repeats.
import torch

_seen = {}


def vision_linear(x, weight, bias):
    key = (x.data_ptr(), tuple(x.shape), weight.data_ptr())
    if key not in _seen:
        _seen[key] = (x, torch.nn.functional.linear(x, weight, bias))
    return _seen[key][1].clone()
