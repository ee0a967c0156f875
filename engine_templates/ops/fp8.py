"""FP8 (e4m3) weights at op level: the block quantization of the engine's FP8 checkpoints, and
the fp8 target of an op whose weights it quantizes.

A weight [..., rows, cols] is e4m3 values `q` and float32 scales, one per block of
block[0] x block[1] elements: scale [..., ceil(rows / block[0]), ceil(cols / block[1])], and the
weight it stands for is q * scale (the multiplier: Qwen's FP8 releases call it `_scale_inv`).
Each block's scale maps its largest magnitude to 448, e4m3's largest value. Op targets use
128 x 128 blocks, the layout of Qwen's FP8 releases and of `engine quantize`.

An fp8 op target (`Fp8Op`) hands the candidate each weight of the full-precision op as e4m3
values followed by its scales, and everything else as the full-precision op draws it (bf16
activations). The oracle is the full-precision op itself: its float64 reference on the weights
before quantization, drawn from the same generator — the candidate is judged against the bf16
model, as the end-to-end FP8 gate judges the FP8 engine, with the fp8 tolerance of the target.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_templates.ops.base import Op

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
BLOCK = (128, 128)  # rows x columns of weight per scale in op targets


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [..., rows, cols] to (e4m3 values, float32 scales): each block's scale maps its
    largest magnitude to 448."""
    rows, cols = w.shape[-2:]
    br, bc = block
    pr, pc = -(-rows // br) * br, -(-cols // bc) * bc
    padded = F.pad(w.float(), (0, pc - cols, 0, pr - rows))  # zero padding: no effect on a maximum
    blocks = padded.view(*w.shape[:-2], pr // br, br, pc // bc, bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero block: any scale
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(*w.shape[:-2], pr, pc)
    return q[..., :rows, :cols].to(FP8).contiguous(), scale.contiguous()


def expand_scale(scale: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """The scales repeated over their blocks, broadcastable to `shape` (one column where a block
    spans every column, as per-channel scales do)."""
    rows, cols = shape[-2:]
    if block[0] > 1:
        scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    if scale.shape[-1] > 1:
        scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return scale


def tile_fits(scale: torch.Tensor, block: tuple[int, int], tile: int) -> bool:
    """Whether a kernel's tiles of `tile` columns each lie in one column of scale blocks, so that
    one scale per row covers a tile: the scales have one column, or a block is a whole number of
    tiles wide."""
    return scale.shape[-1] == 1 or block[1] % tile == 0


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The weight e4m3 values and their block scales stand for, in `dtype`."""
    return q.to(dtype) * expand_scale(scale, block, q.shape).to(dtype)


class Fp8Op(Op):
    """The fp8 target of `base`: its weight arguments `weights` (names of `base`'s signature)
    handed over as e4m3 values, each followed by `<name>_scale` (float32, one per 128 x 128
    block); judged by `base` on the weights before quantization (the module docstring).
    Subclasses give the templates, the PyTorch baseline and the bytes."""

    base: Op
    weights: tuple[str, ...]

    def __init__(self):
        names = []
        for a in self.base.arg_names:
            names += [a, f"{a}_scale"] if a in self.weights else [a]
        self.name = self.base.name
        self.signature = f"{self.name}({', '.join(names)})"
        self.n_outputs = self.base.n_outputs
        self.persistent = tuple(n for n in names if n.removesuffix("_scale") in self.base.persistent)
        assert set(self.weights) <= set(self.base.persistent), "only persistent weights are quantized"

    @property
    def oracle(self) -> Op:
        return self.base

    def shapes(self, model, decode_batches, prefill_tokens, contexts):
        return self.base.shapes(model, decode_batches, prefill_tokens, contexts)

    def odd_shapes(self, model):
        return self.base.odd_shapes(model)

    def inputs(self, shape, dtype, device, gen, dist):
        """The base op's draw (the same generator, so the same values the oracle sees), each
        weight quantized in place of itself."""
        return self._quantized(self.base.inputs(shape, dtype, device, gen, dist))

    def input_sets(self, shape, dtype, device, seeds, dist):
        """The base op's sets (drawn as it draws them), each quantized as `inputs` quantizes one."""
        return [self._quantized(args) for args in self.base.input_sets(shape, dtype, device, seeds, dist)]

    def _quantized(self, base_args: tuple) -> tuple:
        args = []
        for name, a in zip(self.base.arg_names, base_args):
            args += list(quantize_blocks(a)) if name in self.weights else [a]
        return tuple(args)

    def dequantized(self, args: tuple, dtype: torch.dtype) -> tuple:
        """The base op's arguments from this op's: each weight dequantized to `dtype`."""
        out, it = [], iter(args)
        for name in self.base.arg_names:
            a = next(it)
            out.append(dequantize(a, next(it), dtype) if name in self.weights else a)
        return tuple(out)

    def reference(self, *args):
        """The base op's float64 reference on the dequantized weights: what the e4m3 weights
        compute exactly, for tests of a kernel's own error. The harness judges against `oracle`."""
        return self.base.reference(*self.dequantized(args, torch.float64))
