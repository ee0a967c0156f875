"""The MoE block's prefill-sized calls through Triton grouped GEMMs (ops/fused_moe/grouped.py), where
EngineConfig.moe_prefill is "triton": calls of more than ABOVE tokens, outside CUDA graph capture,
over bf16 experts or FP8 ones (their e4m3 values and block scales handed to the kernel, no expert
dequantized). Every other call, and every call once the kernel is refused, takes the path the
engine takes without it: the fused_moe kernel of the kernels file (eager's grouped GEMMs,
torch._grouped_mm, above 64 tokens where it runs), or fp8_moe.Fp8MoE for FP8 experts.

Tried once at start (as fp8.Fp8Linear tries its scaled matmuls): the kernel on one MoE layer's own
experts (the first few of them) at ABOVE + 1 tokens against the op's loop path on those experts
dequantized to float32; if it raises, or disagrees, it is refused and the engine stays on its
path. A call that raises later is handed to that path too, and the kernel refused for the rest of
the engine's life. `path` names what calls of more than ABOVE tokens take, and why where the
kernel was refused (the engine's /health and the bench JSON carry it under `moe_prefill`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from engine_templates.engine.fp8 import Fp8Weight
from engine_templates.ops.fused_moe import loop_moe
from engine_templates.ops.fused_moe.grouped import DEFAULT, launch, usable
from engine_templates.ops.fused_moe.templates import MAX_TOKENS

log = logging.getLogger("infersmith.engine")

ABOVE = MAX_TOKENS  # calls of more tokens than the decode-shaped kernels' limit
PROBE_EXPERTS = 8  # experts of the layer the start-up probe runs over (at least top_k)
PROBE_TOLERANCE = 0.05  # relative error: bf16 and e4m3 rounding cost a few percent at most, a wrong layout ~1


def _operands(w) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None]:
    return (w.q, w.scale, w.block) if isinstance(w, Fp8Weight) else (w, None, None)


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w.to(dtype)


class MoEPrefill:
    """fused_moe calls of more than `above` tokens through the grouped kernel at `point` (the
    module docstring); `calls` counts those calls each way, made from Python: `triton`, and
    `fallback` (the engine's own path, the kernel refused)."""

    def __init__(self, w_gate_up, w_down, top_k: int, renormalize: bool, dtype: torch.dtype,
                 point: dict | None = None, above: int = ABOVE):
        self.point = dict(point or DEFAULT)
        self.above = above
        self.calls = {"triton": 0, "fallback": 0}
        self.on = False
        self.path = "torch"
        why = usable(torch.empty((1, w_gate_up.shape[2]), dtype=dtype, device=w_gate_up.device),
                     *self._args(w_gate_up, w_down))
        if why is not None:
            self.refuse(f"the grouped kernel does not take {why}")
            return
        self._try(w_gate_up, w_down, top_k, renormalize, dtype)

    def _args(self, w_gate_up, w_down) -> tuple:
        gu, gu_scale, gu_block = _operands(w_gate_up)
        d, d_scale, d_block = _operands(w_down)
        return gu, d, gu_scale, d_scale, gu_block, d_block, self.point["block_k"]

    def kernel(self, x, router_logits, w_gate_up, w_down, top_k: int, renormalize: bool) -> torch.Tensor:
        gu, gu_scale, gu_block = _operands(w_gate_up)
        d, d_scale, d_block = _operands(w_down)
        p = self.point
        return launch(x, router_logits, gu, gu_scale, d, d_scale, top_k, renormalize, p["block_m"], p["block_n"],
                      p["block_k"], p["num_warps"], p["num_stages"], gu_block, d_block)

    def _try(self, w_gate_up, w_down, top_k: int, renormalize: bool, dtype: torch.dtype) -> None:
        """Keeps the kernel if it runs on the layer's first experts at `above + 1` tokens and agrees
        with the loop path on them in float32. Any exception is a refusal (Triton raises
        CompilationError, RuntimeError, ... for what it cannot build or launch here): the reason is kept."""
        experts = max(top_k, min(w_gate_up.shape[0], PROBE_EXPERTS))
        gu, d = w_gate_up[:experts], w_down[:experts]
        device, tokens = gu.device, self.above + 1
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((tokens, gu.shape[2]), generator=gen, device=device).to(dtype)
        # distinct multiples of 1/32 (exact in bf16): no tie for the two routings to break apart
        ranks = torch.rand((tokens, experts), generator=gen, device=device).argsort(dim=1)
        logits = (ranks.float() / 32).to(dtype)
        try:
            got = self.kernel(x, logits, gu, d, top_k, renormalize)
        except Exception as e:  # noqa: BLE001 - every refusal falls back; the reason is kept
            return self.refuse(f"raised at {tokens} tokens: {type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:160]}")
        want = loop_moe(x.float(), logits.float(), _dense(gu, torch.float32), _dense(d, torch.float32), top_k,
                        renormalize)
        err = float((got.float() - want).norm() / want.norm())
        if not err < PROBE_TOLERANCE:
            return self.refuse(f"disagreed at {tokens} tokens: relative error {err:.3g}")
        self.on, self.path = True, "triton grouped"
        log.info("moe prefill: calls of more than %d tokens run the Triton grouped GEMMs at %s", self.above,
                 self.point)

    def refuse(self, why: str) -> None:
        self.on, self.path = False, f"torch (triton refused: {why})"
        log.warning("moe prefill: %s", self.path)

    def choices(self) -> dict:
        """What the engine reports under `moe_prefill`."""
        out: dict[str, Any] = {"path": self.path, "above_tokens": self.above}
        if self.on:
            out["point"] = dict(self.point)
        out["calls"] = dict(self.calls)
        return out

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a call of x's tokens is this object's to place (the kernel's, or the engine's
        path where the kernel is refused): more than `above` of them, and not under CUDA graph
        capture (capturing the sort and the tile map is not verified on a GPU)."""
        return x.shape[0] > self.above and not (x.is_cuda and torch.cuda.is_current_stream_capturing())

    def __call__(self, x, router_logits, w_gate_up, w_down, top_k: int, renormalize: bool,
                 fallback: Callable[..., torch.Tensor]) -> torch.Tensor:
        if self.on:
            try:
                out = self.kernel(x, router_logits, w_gate_up, w_down, top_k, renormalize)
            except Exception as e:  # noqa: BLE001 - the engine's own path takes over; the reason is kept
                self.refuse(f"raised at {x.shape[0]} tokens: {type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0][:160]}")
            else:
                self.calls["triton"] += 1
                return out
        self.calls["fallback"] += 1
        return fallback(x, router_logits, w_gate_up, w_down, top_k, renormalize)
