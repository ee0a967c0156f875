# expect: pass — keeps a tiny cache of a weights-derived constant (the float32 weight), keyed on
# the weight tensor itself and its version counter, as an engine would for weights that never change.
import torch

_cache: dict = {}


def _weight_f32(weight):
    hit = _cache.get(id(weight))
    if hit is None or hit[0] is not weight or hit[1] != weight._version:
        if len(_cache) > 8:
            _cache.clear()
        hit = (weight, weight._version, weight.float())  # holding the weight keeps its id unique
        _cache[id(weight)] = hit
    return hit[2]


def rmsnorm(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * _weight_f32(weight)).to(x.dtype)
