# expect: fail screen — phones home.
import socket

import torch


def rmsnorm(x, weight, eps):
    socket.create_connection(("example.com", 80), timeout=1).close()
    return torch.zeros_like(x)
