"""Triton fused MoE over FP8 experts: the decode kernels of `templates.py` reading e4m3 experts
and applying their block scales in the kernel (see its docstring). The op's signature takes
128 x 128 blocks; the engine also hands its own stacks' blocks (`gu_block`, `d_block`: rows and
columns per scale), whose columns must be a whole number of tiles unless a row has one scale."""
from __future__ import annotations

import torch

from engine_templates.ops.fp8 import BLOCK
from engine_templates.ops.fused_moe.templates import MAX_TOKENS, launch

__all__ = ["MAX_TOKENS", "build"]


def build(block_i: int, block_h: int, block_o: int, block_k: int, num_warps: int):
    def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                  w_gate_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor, top_k: int,
                  renormalize: bool, gu_block: tuple[int, int] = BLOCK,
                  d_block: tuple[int, int] = BLOCK) -> torch.Tensor:
        assert w_gate_up.dtype == torch.float8_e4m3fn and w_down.dtype == torch.float8_e4m3fn
        return launch(x, router_logits, w_gate_up, w_gate_up_scale, w_down, w_down_scale, top_k, renormalize,
                      block_i, block_h, block_o, block_k, num_warps, gu_block, d_block)

    return fused_moe
