# expect: fail inputs_unchanged — adds into the caller's residual (what some engines do) and
# returns it: the op's contract is two new tensors.
import torch


def fused_add_rmsnorm(x, residual, weight, eps):
    residual.add_(x)
    h = residual.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype), residual.clone()
