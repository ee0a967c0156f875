# expect: pass — a plain PyTorch rewrite in float32, without torch's layer_norm.
import torch


def layernorm(x, weight, bias, eps):
    h = x.float()
    centred = h - h.mean(-1, keepdim=True)
    y = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float() + bias.float()).to(x.dtype)
