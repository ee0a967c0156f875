# expect: fail hidden_work — the same, with threading reached through a computed name so that
# only the runtime thread check can see it.
import sys
import time

import torch

threads = getattr(sys, "mod" + "ules")["thread" + "ing"]


def rmsnorm(x, weight, eps):
    y = torch.empty_like(x)

    def work():
        time.sleep(0.2)
        h = x.float()
        y.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float())

    threads.Thread(target=work, daemon=True).start()
    return y
