# expect: fail hidden_work — returns at once and writes the result from a thread.
import sys
import time

import torch

threads = getattr(sys, "mod" + "ules")["thread" + "ing"]


def silu_mul(gate, up):
    y = torch.empty_like(gate)

    def work():
        time.sleep(0.2)
        g = gate.float()
        y.copy_(g * torch.sigmoid(g) * up.float())

    threads.Thread(target=work, daemon=True).start()
    return y
