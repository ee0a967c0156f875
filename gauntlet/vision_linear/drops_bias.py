# expect: fail accuracy — the text models' linear (no bias): one add and a read of the bias fewer.
import torch


def vision_linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight)
