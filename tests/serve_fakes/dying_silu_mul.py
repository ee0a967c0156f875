"""A kernel that kills its server after a fixed number of calls: right answers (so the engine
passes the accuracy gate), then the process is gone in the middle of the AIPerf load."""
import os

import torch

LIMIT = 110  # the test's accuracy prompts take fewer silu_mul calls (2 layers x 6 steps x 6 prompts)
calls = 0


def silu_mul(gate, up):
    global calls
    calls += 1
    if calls > LIMIT:
        os._exit(3)
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
