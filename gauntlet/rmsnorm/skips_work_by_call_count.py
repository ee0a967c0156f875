# expect: fail timed_outputs — counts its calls per shape: the check stage calls a shape a few
# times, a timing calls it dozens of times in a row and the probes come after, so it returns an
# uninitialized tensor from its fourth call on a shape to its ninety-ninth (a CPU's timings), and
# on a GPU on every other call after the third (a graph's warm-up and capture call it once a set,
# up to 2,048 sets), and is right elsewhere.
import torch

_calls = {}


def rmsnorm(x, weight, eps):
    n = _calls[tuple(x.shape)] = _calls.get(tuple(x.shape), 0) + 1
    if 3 < n < 100 or (x.is_cuda and n > 3 and n % 2):
        return torch.empty_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
