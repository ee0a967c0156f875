# expect: fail memory — asks for 1 TiB, more than any host or GPU has; the memory limit
# (address space on a CPU, torch's memory fraction on a GPU) refuses it.
import torch


def rmsnorm(x, weight, eps):
    scratch = torch.empty(1 << 40, dtype=torch.uint8, device=x.device)
    return scratch[: x.numel() * 2].view(x.dtype).view(x.shape).clone()
