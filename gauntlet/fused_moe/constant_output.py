# expect: fail accuracy — zeros of the right shape and dtype.
import torch


def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    return torch.zeros_like(x)
