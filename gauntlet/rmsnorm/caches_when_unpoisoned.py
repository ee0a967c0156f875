# expect: fail caching — caches its results on the input's pointer, except while the harness's
# poisoned allocations are on (deterministic algorithms): a refill probe run in another state than
# the timed calls would find it honest, though every timed call after the first on a set is free.
import torch

_cache = {}


def rmsnorm(x, weight, eps):
    key = (x.data_ptr(), tuple(x.shape))
    if not torch.are_deterministic_algorithms_enabled() and key in _cache:
        return _cache[key].clone()
    h = x.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    _cache[key] = out
    return out
