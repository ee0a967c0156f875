"""FP8 (e4m3) weights: how the engine stores them, makes them from bf16, and multiplies by them.

A weight [..., out, in] is kept as e4m3 values `q` and float32 scales, one per block of
block[0] x block[1] elements: scale [..., ceil(out / block[0]), ceil(in / block[1])], and the
weight it stands for is q * scale. Qwen's FP8 releases use 128 x 128 blocks and name the scale
`<name>_scale_inv` (despite the name, the multiplier); `engine quantize` writes the same layout,
or one scale per output channel (a block of one row by the whole width).

The engine stacks matrices (q/k/v, gate/up, the experts): a stack keeps the checkpoint's block
height where every part's rows are a multiple of it (every Qwen3 size), and otherwise one scale
row per weight row (the block's scale repeated: the same values, exactly).

The matmul is `Fp8Linear`, chosen once per engine: on a GPU with FP8 tensor cores (compute
capability 8.9 and up) torch's scaled matmul — per-channel weights with per-token scales of the
activations (torch._scaled_mm, row-wise), 128 x 128 blocks with 1 x 128 activation groups
(torch.nn.functional.scaled_mm, block-wise) — each tried once on a small matrix at start and
replaced by the fallback if torch refuses it on this GPU; everywhere else, and as the fallback,
the weight dequantized to the activations' dtype and an ordinary matmul. The experts go to the
fused_moe kernel's fp8 variant where the engine has one (fp8_moe.py), else `fused_moe_fp8`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_templates.ops.fp8 import FP8, FP8_MAX, expand_scale, quantize_blocks

log = logging.getLogger("infersmith.engine")

ACT_GROUP = 128  # activation columns per scale in the block-wise scaled matmul


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers and experts are quantized: `block` (rows, cols) per scale, or
    None: one scale per output channel."""

    block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"weight_block_size must be two positive integers, not {list(self.block)}")

    def block_for(self, cols: int) -> tuple[int, int]:
        return self.block or (1, cols)


class Fp8Weight:
    """e4m3 values and their block scales; indexing the leading (expert) dimension gives a view."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        assert q.dtype == FP8 and scale.dtype == torch.float32
        rows, cols = q.shape[-2:]
        assert scale.shape[-2:] == (-(-rows // block[0]), -(-cols // block[1])), (q.shape, scale.shape, block)
        self.q, self.scale, self.block = q, scale, block

    @classmethod
    def empty(cls, shape: tuple[int, ...], block: tuple[int, int], device) -> Fp8Weight:
        *lead, rows, cols = shape
        scale = torch.ones((*lead, -(-rows // block[0]), -(-cols // block[1])), dtype=torch.float32, device=device)
        return cls(torch.empty(shape, dtype=FP8, device=device), scale, block)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __getitem__(self, index) -> Fp8Weight:
        return Fp8Weight(self.q[index], self.scale[index], self.block)

    def rows(self, start: int, end: int) -> Fp8Weight:
        """Rows [start, end) of the last-but-one dimension, as a view (start on a block boundary)."""
        br = self.block[0]
        assert start % br == 0, (start, br)
        return Fp8Weight(self.q[..., start:end, :], self.scale[..., start // br:-(-end // br), :], self.block)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.q.to(dtype) * expand_scale(self.scale, self.block, self.q.shape).to(dtype)

    def copy_(self, other: Fp8Weight) -> None:
        """Fill from a weight of the same shape and block height, or of taller blocks whose scales
        are repeated row by row (a stack whose parts do not align with them)."""
        assert other.shape == self.shape and other.block[1] == self.block[1], (other.shape, self.shape)
        self.q.copy_(other.q)
        if other.block[0] == self.block[0]:
            self.scale.copy_(other.scale)
        else:
            assert self.block[0] == 1, (other.block, self.block)
            self.scale.copy_(other.scale.repeat_interleave(other.block[0], dim=-2)[..., :self.shape[-2], :])

    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()


def quantize(w: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """`w` [..., rows, cols] to e4m3: each block's scale maps its largest magnitude to 448."""
    return Fp8Weight(*quantize_blocks(w, block), block)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [tokens, cols] to e4m3 with one float32 scale per token (and per `group`
    columns): (q, scale [tokens, 1 or cols / group])."""
    t, cols = x.shape
    g = group or cols
    groups = x.float().reshape(t, cols // g, g)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(t, cols).to(FP8), scale


def linear_dequant(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    return F.linear(x, w.dequantize(x.dtype))


def linear_rowwise(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """Per-channel weights: x quantized per token, then torch._scaled_mm (bf16 out)."""
    xq, sx = quantize_rows(x)
    return torch._scaled_mm(xq, w.q.t(), scale_a=sx, scale_b=w.scale.view(1, -1), out_dtype=x.dtype)


def linear_blockwise(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """128 x 128 weight blocks: x quantized per token and 128 columns, then the block-wise scaled
    matmul (scales of x column-major, as cuBLAS asks)."""
    from torch.nn.functional import ScalingType, scaled_mm

    xq, sx = quantize_rows(x, ACT_GROUP)
    return scaled_mm(xq, w.q.t(), sx.t().contiguous().t(), ScalingType.BlockWise1x128, w.scale.t(),
                     ScalingType.BlockWise128x128, output_dtype=x.dtype)


class Fp8Linear:
    """y = x @ w.T for plain and FP8 weights, by the fastest path this device takes (module
    docstring); `choices` records which, and why where a path was refused."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.paths = {"channel": linear_dequant, "block": linear_dequant}
        self.choices: dict[str, str] = {"channel": "dequant", "block": "dequant"}
        if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 9):
            self._try("channel", linear_rowwise, device, None)
            self._try("block", linear_blockwise, device, (128, 128))

    def _try(self, kind: str, path, device, block) -> None:
        """Keeps `path` for `kind` if it runs here and agrees with the dequantized matmul on a
        small weight, 1 and 40 tokens; torch refuses what the GPU or its build cannot do."""
        gen = torch.Generator(device=device).manual_seed(0)
        w = quantize(torch.randn((512, 768), generator=gen, device=device), block or (1, 768))
        for tokens in (1, 40):
            x = torch.randn((tokens, 768), generator=gen, device=device).to(torch.bfloat16)
            try:
                got = path(x, w)
            except RuntimeError as e:  # unsupported scaling on this device or torch build
                self.choices[kind] = f"dequant ({path.__name__} refused: {str(e).splitlines()[0][:160]})"
                log.info("fp8 %s weights: %s", kind, self.choices[kind])
                return
            want = linear_dequant(x.float(), w)
            err = float((got.float() - want).norm() / want.norm())
            if not err < 0.1:  # activation rounding to e4m3 costs a few percent, a wrong layout ~1
                self.choices[kind] = f"dequant ({path.__name__} disagreed: relative error {err:.3g})"
                log.warning("fp8 %s weights: %s", kind, self.choices[kind])
                return
        self.paths[kind], self.choices[kind] = path, path.__name__.removeprefix("linear_")

    def __call__(self, x: torch.Tensor, w) -> torch.Tensor:
        if not isinstance(w, Fp8Weight):
            return F.linear(x, w)
        kind = "channel" if w.block[0] == 1 and w.scale.shape[-1] == 1 else "block"
        if kind == "block" and (w.block != (128, 128) or x.shape[-1] % ACT_GROUP):
            return linear_dequant(x, w)  # blocks of other sizes (or rows that are not whole groups)
        return self.paths[kind](x, w)


def fused_moe_fp8(x, router_logits, w_gate_up: Fp8Weight, w_down: Fp8Weight, top_k: int, renormalize: bool,
                  fused_moe):
    """The MoE block over FP8 experts, dequantized (where the engine's fused_moe kernel has no fp8
    variant, or leaves the call to eager's grouped GEMMs: fp8_moe.Fp8MoE). Few tokens (tokens *
    top_k <= experts, decode): only the routed experts are gathered and dequantized, then
    multiplied in one batch (no host sync, so a CUDA graph captures it). More: the layer's experts
    dequantized whole and handed to `fused_moe` (the engine's kernel for the op)."""
    from engine_templates.ops.fused_moe import route

    if x.shape[0] * top_k > w_gate_up.shape[0]:
        return fused_moe(x, router_logits, w_gate_up.dequantize(x.dtype), w_down.dequantize(x.dtype), top_k,
                         renormalize)
    weights, experts = route(router_logits, top_k, renormalize)
    flat = experts.flatten()
    inter = w_down.shape[2]
    gu = torch.bmm(w_gate_up[flat].dequantize(x.dtype), x.repeat_interleave(top_k, dim=0)[:, :, None]).squeeze(2)
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    out = torch.bmm(w_down[flat].dequantize(x.dtype), act[:, :, None]).squeeze(2)
    return (out.view(-1, top_k, out.shape[-1]) * weights.to(out.dtype)[..., None]).sum(dim=1)
