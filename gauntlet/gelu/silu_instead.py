# expect: fail accuracy — the activation of the language models' MLP (x * sigmoid(x)) in place
# of GELU: the same shape of curve, a tenth off at every unit input.
import torch


def gelu(x):
    return torch.nn.functional.silu(x)
