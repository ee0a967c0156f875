# expect: fail screen — imports the harness to patch its checks.
import harness.checks
import torch


def rmsnorm(x, weight, eps):
    return torch.zeros_like(x)
