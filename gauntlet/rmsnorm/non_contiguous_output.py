# expect: fail output_form — right values in a transposed buffer: a strided view the harness would
# have to copy to read, so what the call wrote is not what the caller gets.
import torch


def rmsnorm(x, weight, eps):
    h = x.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out.t().contiguous().t()
