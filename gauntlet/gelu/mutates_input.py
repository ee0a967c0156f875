# expect: fail inputs_unchanged — a right answer, computed in place in the input.
import torch


def gelu(x):
    x.copy_(torch.nn.functional.gelu(x.float()).to(x.dtype))
    return x.clone()
