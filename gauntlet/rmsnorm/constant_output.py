# expect: fail accuracy — a constant of the right shape and dtype.
import torch


def rmsnorm(x, weight, eps):
    return torch.ones_like(x)
