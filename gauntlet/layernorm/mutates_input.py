# expect: fail inputs_unchanged — a right answer, computed in place in the input.
import torch


def layernorm(x, weight, bias, eps):
    x.copy_(torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype))
    return x.clone()
