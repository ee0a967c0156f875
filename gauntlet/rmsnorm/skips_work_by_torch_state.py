# expect: fail timed_outputs — right whenever the harness's poisoned allocations are on (how its
# judged calls used to run: deterministic algorithms, uninitialized memory filled), and an
# uninitialized tensor otherwise: it reads a global flag to tell a judged call from a timed one.
import torch


def rmsnorm(x, weight, eps):
    if not torch.are_deterministic_algorithms_enabled():
        return torch.empty_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
