# expect: fail memory — asks for 100 GB; the memory limit refuses it.
import torch


def rmsnorm(x, weight, eps):
    scratch = torch.empty(100 << 30, dtype=torch.uint8, device=x.device)
    return scratch[: x.numel() * 2].view(x.dtype).view(x.shape).clone()
