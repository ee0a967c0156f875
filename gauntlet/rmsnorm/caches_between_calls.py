# expect: fail caching — caches its results on the input's pointer and recomputes only when more
# than 15 us passed since its last return (an idle device, a synchronize, the harness busy between
# calls): right values while timed, for the timed calls cycle over unchanged inputs, and right
# values in the refill probes, which come after a pause. Only inputs refilled between two timed
# calls find the cache stale.
import time

import torch

_cache, _last = {}, [0.0]


def rmsnorm(x, weight, eps):
    key = (x.data_ptr(), tuple(x.shape))
    if time.perf_counter() - _last[0] < 15e-6 and key in _cache:
        out = _cache[key].clone()
    else:
        h = x.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        _cache[key] = out.clone()
    _last[0] = time.perf_counter()
    return out
