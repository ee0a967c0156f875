# expect: fail finite — writes only the first half of the rows; the rest is whatever memory held.
import torch


def rmsnorm(x, weight, eps):
    y = torch.empty_like(x)
    half = max(1, x.shape[0] // 2)
    h = x[:half].float()
    y[:half] = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y
