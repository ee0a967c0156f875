# expect: fail accuracy — computes once per shape, then returns the same buffer.
import torch

_buffers = {}


def silu_mul(gate, up):
    key = (tuple(gate.shape), gate.dtype)
    if key not in _buffers:
        g = gate.float()
        _buffers[key] = (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
    return _buffers[key]
