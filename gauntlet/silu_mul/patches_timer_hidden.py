# expect: fail timer_integrity — replaces torch.cuda.synchronize through a computed name.
import sys

import torch

cuda = getattr(sys, "mod" + "ules")["torch"].cuda
setattr(cuda, "synchro" + "nize", lambda *a, **k: None)


def silu_mul(gate, up):
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
