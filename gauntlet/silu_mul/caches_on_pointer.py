# expect: fail caching — remembers results by input pointers, keeping the inputs alive.
import torch

_seen = {}


def silu_mul(gate, up):
    key = (gate.data_ptr(), up.data_ptr(), tuple(gate.shape))
    if key not in _seen:
        g = gate.float()
        _seen[key] = (gate, up, (g * torch.sigmoid(g) * up.float()).to(gate.dtype))
    return _seen[key][2].clone()
