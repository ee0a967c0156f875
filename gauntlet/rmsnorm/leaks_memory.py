# expect: crash memory — keeps 512 MiB of touched host memory per call, wherever it runs;
# the resident-memory watchdog kills it. (A device-memory leak is refused by torch's memory
# fraction instead, as allocates_huge shows.)
import torch

_kept = []


def rmsnorm(x, weight, eps):
    _kept.append(torch.ones(512 << 20, dtype=torch.uint8))
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
