# expect: fail caching — caches its results on the input's pointer and uses the cache only when it
# is called more than 100 us after its last return and outside the poisoned allocations of the check
# stage: nothing is gained while timed (calls back to back), but an engine that calls it between
# steps gets stale results. The bench stage's probes come after a pause, in the state the calls were
# timed in, and their refilled inputs find the cache stale.
import time

import torch

_cache, _last = {}, [0.0]


def rmsnorm(x, weight, eps):
    key = (x.data_ptr(), tuple(x.shape))
    paused = time.perf_counter() - _last[0] > 100e-6
    if paused and not torch.are_deterministic_algorithms_enabled() and key in _cache:
        out = _cache[key].clone()
    else:
        h = x.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        _cache[key] = out.clone()
    _last[0] = time.perf_counter()
    return out
