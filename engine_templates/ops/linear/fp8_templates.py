"""Triton linear over FP8 weights: the tiles of `templates.py` reading e4m3 weights and applying
their 128 x 128 block scales in the kernel (see its docstring); `fp8_dot` also quantizes the
activations to e4m3 per token and step and multiplies on FP8 tensor cores."""
from __future__ import annotations

import torch

from engine_templates.ops.linear.templates import launch


def build(block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, fp8_dot: int):
    def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
        assert weight.dtype == torch.float8_e4m3fn and weight_scale.dtype == torch.float32
        return launch(x, weight, weight_scale, block_m, block_n, block_k, group_m, num_warps, num_stages,
                      fp8_dot=bool(fp8_dot))

    return linear
