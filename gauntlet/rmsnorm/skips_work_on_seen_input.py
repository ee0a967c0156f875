# expect: fail timed_outputs — judged calls get inputs drawn for them, a timing rotates through a
# few input sets: it keeps a weak reference to every input it was given and returns an
# uninitialized tensor for an input object it has seen before (a timed one, still alive).
import weakref

import torch

_seen = weakref.WeakValueDictionary()


def rmsnorm(x, weight, eps):
    if _seen.get(id(x)) is x:
        return torch.empty_like(x)
    _seen[id(x)] = x
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
