# expect: fail screen — launches on its own CUDA stream and never joins it back.
import torch


def rmsnorm(x, weight, eps):
    if x.is_cuda:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
