"""The MoE block over FP8 experts: the e4m3 experts and their scales handed straight to the fp8
variant of the engine's fused_moe kernel where it has one, dequantized where it has none.

The fp8 variant is the fused_moe op's fp8 target's template of the same name as the kernels
file's choice (today `gemv`, whose SCALED kernels apply the block scales in the kernel and read an
expert at one byte a weight), built at the kernels file's point with each tile narrowed, where it
must, to one that lies in one column of the experts' scale blocks (the fp8 template's space stops
at 128 columns). It takes every call the bf16 template would take: with the decode-shaped `gemv`,
calls over its token limit go to eager's grouped GEMMs where those run (kernels.MoEPrefillRoute),
and for them the layer's experts are dequantized whole (fp8.fused_moe_fp8), as they are for every
call where no fp8 kernel applies: fused_moe `eager`, `reference` or `free` (each takes bf16
experts), or scale blocks narrower than every tile of the template.
"""
from __future__ import annotations

import logging

import torch

from engine_templates.engine.fp8 import Fp8Weight, fused_moe_fp8
from engine_templates.engine.kernels import KernelSet, MoEPrefillRoute
from engine_templates.ops import FP8_OPS
from engine_templates.ops.fp8 import tile_fits
from engine_templates.ops.fused_moe import grouped_fits

log = logging.getLogger("infersmith.engine")

TILES = (("block_h", "w_gate_up"), ("block_k", "w_down"))  # a template tile and the experts it walks


class Fp8MoE:
    """fused_moe over one model's FP8 experts (every MoE layer shares their layout). `path` says
    which path calls take: "scaled <template>" or "dequant (why)"; `dequant_above`: the token count
    above which calls are dequantized for eager's grouped GEMMs instead (None: never). `calls`
    counts the calls of each path made from Python (a replayed CUDA graph adds none)."""

    def __init__(self, kernels: KernelSet, w_gate_up: Fp8Weight, w_down: Fp8Weight, top_k: int,
                 dtype: torch.dtype):
        self.kernel = kernels.fused_moe  # what the dequantized experts go to
        self.calls = {"scaled": 0, "dequant": 0}
        self.dequant_above: int | None = None
        self.scaled, self.path = _fp8_variant(kernels.choices["fused_moe"], {"w_gate_up": w_gate_up,
                                                                             "w_down": w_down})
        if self.scaled is not None and isinstance(self.kernel, MoEPrefillRoute):
            experts, _, hidden = w_gate_up.shape
            if grouped_fits(experts, hidden, w_down.shape[2], dtype, w_gate_up.device):
                # as the bf16 route: eager gathers up to experts / top_k tokens, and groups above
                self.dequant_above = max(self.kernel.max_tokens, experts // top_k)
        log.info("fp8 experts: %s%s", self.path, "" if self.dequant_above is None else
                 f"; calls of more than {self.dequant_above} tokens dequantized for eager's grouped GEMMs")

    def choices(self) -> dict:
        """What `fp8` reports of the experts (LLMEngine.kernel_choices)."""
        out = {"moe": self.path}
        if self.dequant_above is not None:
            out["moe_dequant_above_tokens"] = self.dequant_above
        return out

    def __call__(self, x, router_logits, w_gate_up: Fp8Weight, w_down: Fp8Weight, top_k: int, renormalize: bool):
        # Under CUDA graph capture the scaled kernel keeps every call, as the bf16 route's template does.
        if self.scaled is not None and (self.dequant_above is None or x.shape[0] <= self.dequant_above
                                        or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            self.calls["scaled"] += 1
            return self.scaled(x, router_logits, w_gate_up.q, w_gate_up.scale, w_down.q, w_down.scale, top_k,
                               renormalize, w_gate_up.block, w_down.block)
        self.calls["dequant"] += 1
        return fused_moe_fp8(x, router_logits, w_gate_up, w_down, top_k, renormalize, self.kernel)


def _fp8_variant(choice: dict, experts: dict[str, Fp8Weight]):
    """(the fp8 template built for these experts, "scaled <name>[ (narrowed tiles)]"), or (None,
    "dequant (why)")."""
    if choice["impl"] != "template":
        return None, f"dequant (fused_moe is {choice['impl']}, which takes bf16 experts)"
    template = FP8_OPS["fused_moe"].templates.get(choice["template"])
    if template is None:
        return None, f"dequant (the fused_moe template {choice['template']} has no fp8 variant)"
    point, narrowed = dict(choice["point"]), []
    for tile, name in TILES:
        w = experts[name]
        fits = [v for v in template.space[tile] if v <= point[tile] and tile_fits(w.scale, w.block, v)]
        if not fits:
            return None, (f"dequant ({name} scale blocks are {w.block[1]} columns wide: no {tile} of "
                          f"{template.space[tile]} up to {point[tile]} lies in one)")
        if max(fits) != point[tile]:
            narrowed.append(f"{tile} {point[tile]} -> {max(fits)}")
            point[tile] = max(fits)
    return template.build(point), f"scaled {template.name}" + (f" ({', '.join(narrowed)})" if narrowed else "")
