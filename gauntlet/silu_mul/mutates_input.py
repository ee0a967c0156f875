# expect: fail inputs_unchanged — a right answer, computed in place in `up`.
import torch


def silu_mul(gate, up):
    up.mul_(torch.sigmoid(gate.float()).to(up.dtype) * gate)
    return up.clone()
