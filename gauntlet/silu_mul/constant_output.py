# expect: fail accuracy — a constant of the right shape and dtype.
import torch


def silu_mul(gate, up):
    return torch.full_like(gate, 0.25)
