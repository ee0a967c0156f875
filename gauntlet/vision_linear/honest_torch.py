# expect: pass — a plain PyTorch rewrite: the product in float32, the bias added before rounding.
import torch


def vision_linear(x, weight, bias):
    return (x.float() @ weight.float().t() + bias.float()).to(x.dtype)
