# expect: fail screen — does its work in another process.
import subprocess

import torch


def rmsnorm(x, weight, eps):
    subprocess.run(["true"])
    return torch.zeros_like(x)
