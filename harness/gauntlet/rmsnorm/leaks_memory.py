# expect: crash memory — keeps 512 MiB of touched memory per call; the watchdog kills it.
import torch

_kept = []


def rmsnorm(x, weight, eps):
    _kept.append(torch.ones(512 << 20, dtype=torch.uint8, device=x.device))
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
