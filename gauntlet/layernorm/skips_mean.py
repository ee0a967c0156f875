# expect: fail accuracy — RMSNorm with a bias: divides by the root mean square without taking the
# mean out first (one reduction fewer), right only for rows whose mean is zero.
import torch


def layernorm(x, weight, bias, eps):
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float() + bias.float()).to(x.dtype)
