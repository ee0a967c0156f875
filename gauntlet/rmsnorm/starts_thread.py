# expect: fail screen — finishes the work on a thread after returning.
import threading

import torch


def rmsnorm(x, weight, eps):
    y = torch.empty_like(x)

    def work():
        h = x.float()
        y.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float())

    threading.Thread(target=work).start()
    return y
