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
(torch.nn.functional.scaled_mm, block-wise), their scales laid out as torch checks them
(rowwise_scales, blockwise_scales) — each tried once at start on one token and on 40, at a K whose
128-column blocks are a multiple of 4 and one whose are not, and replaced by the fallback if torch
refuses it in any way or disagrees; everywhere else, and as the fallback, the weight dequantized
to the activations' dtype and an ordinary matmul. `Fp8Linear.choices` names the path each kind of
weight takes, and why a scaled one was refused (the engine's `/health` and the bench JSON carry it).
The experts go to the fused_moe kernel's fp8 variant where the engine has one (fp8_moe.py), else
`fused_moe_fp8`.
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


def quantize_rows(x: torch.Tensor, group: int | None = None,
                  column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [tokens, cols] to e4m3 with one float32 scale per token (and per `group`
    columns): (q, scale [tokens, 1 or cols / group], column-major if asked). On a GPU in one kernel
    (fp8_activations.py), elsewhere with torch's ops; the same bits either way."""
    t, cols = x.shape
    g = group or cols
    if x.is_cuda:
        from engine_templates.engine.fp8_activations import quantize_groups

        return quantize_groups(x, g, column_major)
    groups = x.float().reshape(t, cols // g, g)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    if column_major:
        scale = torch.empty_strided(scale.shape, (1, t), dtype=scale.dtype, device=scale.device).copy_(scale)
    return q.view(t, cols).to(FP8), scale


def rowwise_scales(sx: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales of the row-wise scaled matmul as torch checks them (aten ScaledBlas.cpp,
    is_rowwise_scaling): x's (tokens, 1) and the weight's (1, out), float32, both contiguous."""
    return sx.contiguous(), w.scale.reshape(1, -1)


def blockwise_scales(sx: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales of the 1 x 128 by 128 x 128 scaled matmul as torch checks them (aten
    ScaledBlas.cpp, _scaled_block1x128_block128x128): x's (tokens, K/128) with strides (1, tokens),
    column-major also for one token (where a transposed copy keeps its strides (K/128, 1)); the
    weight's (L4, out/128) with strides (1, L4), L4 being K/128 rounded up to a multiple of 4 (the
    padding, zeros, lies past the last block of K)."""
    tokens, groups = sx.shape
    a = sx
    if sx.stride(0) != 1 or (groups > 1 and sx.stride(1) != tokens):  # not column-major already
        a = torch.empty_strided((tokens, groups), (1, tokens), dtype=torch.float32, device=sx.device).copy_(sx)
    blocks_n, blocks_k = w.scale.shape
    l4 = -(-blocks_k // 4) * 4
    if l4 == blocks_k and w.scale.stride() == (blocks_k, 1):
        return a, w.scale.t()
    b = torch.zeros((blocks_n, l4), dtype=torch.float32, device=w.scale.device)
    b[:, :blocks_k] = w.scale
    return a, b.t()


def linear_dequant(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    return F.linear(x, w.dequantize(x.dtype))


def linear_rowwise(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """Per-channel weights: x quantized per token, then torch._scaled_mm (bf16 out)."""
    xq, sx = quantize_rows(x)
    scale_a, scale_b = rowwise_scales(sx, w)
    return torch._scaled_mm(xq, w.q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)


def linear_blockwise(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """128 x 128 weight blocks: x quantized per token and 128 columns, then the block-wise scaled
    matmul (torch.nn.functional.scaled_mm)."""
    from torch.nn.functional import ScalingType, scaled_mm

    xq, sx = quantize_rows(x, ACT_GROUP, column_major=True)
    scale_a, scale_b = blockwise_scales(sx, w)
    return scaled_mm(xq, w.q.t(), scale_a, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise128x128,
                     output_dtype=x.dtype)


# The probe's shapes: one token (decode at batch 1) and more than 16; K a multiple of 512 (K/128
# a multiple of 4, as every Qwen3 projection) and one that is not (the weight scales padded).
PROBE_TOKENS = (1, 40)
PROBE_K = (512, 768)


class Fp8Linear:
    """y = x @ w.T for plain and FP8 weights, by the fastest path this device takes (module
    docstring); `choices` names the path of each kind of weight, and why where one was refused."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.paths = {"channel": linear_dequant, "block": linear_dequant}
        self.choices: dict[str, str] = {"channel": "dequant", "block": "dequant"}
        if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 9):
            self._try("channel", linear_rowwise, device, None)
            self._try("block", linear_blockwise, device, (128, 128))

    def _try(self, kind: str, path, device, block) -> None:
        """Keeps `path` for `kind` if it runs here and agrees with the dequantized matmul at every
        probe shape. Any exception is a refusal (torch raises ValueError, RuntimeError,
        NotImplementedError for what the GPU or its build cannot do; an older torch lacks the
        names): the kind stays on the dequantized matmul, and `choices` says why."""
        gen = torch.Generator(device=device).manual_seed(0)
        for k in PROBE_K:
            w = quantize(torch.randn((256, k), generator=gen, device=device), block or (1, k))
            for tokens in PROBE_TOKENS:
                x = torch.randn((tokens, k), generator=gen, device=device).to(torch.bfloat16)
                try:
                    got = path(x, w)
                except Exception as e:  # noqa: BLE001 - every refusal falls back; the reason is kept
                    why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
                    return self.refuse(kind, f"{path.__name__} refused at {tokens} x {k}: {why}")
                want = linear_dequant(x.float(), w)
                err = float((got.float() - want).norm() / want.norm())
                if not err < 0.1:  # activation rounding to e4m3 costs a few percent, a wrong layout ~1
                    return self.refuse(kind, f"{path.__name__} disagreed at {tokens} x {k}: relative error {err:.3g}")
        self.paths[kind], self.choices[kind] = path, path.__name__.removeprefix("linear_")
        log.info("fp8 %s weights: %s", kind, self.choices[kind])

    def refuse(self, kind: str, why: str) -> None:
        """Puts `kind` of weight on the dequantized matmul: a refused path, or the reference a
        comparison wants."""
        self.paths[kind], self.choices[kind] = linear_dequant, f"dequant ({why})"
        log.warning("fp8 %s weights: %s", kind, self.choices[kind])

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
