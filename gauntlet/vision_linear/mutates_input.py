# expect: fail inputs_unchanged — a right answer, then the activations' buffer reused as scratch
# (zeroed in place), as a fused layer might do with an input it thinks is dead.
import torch


def vision_linear(x, weight, bias):
    y = torch.nn.functional.linear(x, weight, bias)
    x.zero_()
    return y
