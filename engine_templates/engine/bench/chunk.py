"""`engine bench --chunk-sweep`: the prefill chunk (the step's token budget, EngineConfig's
max_num_batched_tokens) chosen from a measured GEMM-efficiency sweep.

A layer's GEMMs at T tokens — the q/k/v and output projections, and the MLP's gate/up and down or,
for a MoE layer, the router and the experts by the op's eager (its grouped GEMMs where they run),
on the op's own routing — on random weights of the model's shape, timed at each T of the sweep.
Efficiency is their FLOPs over the time, as a fraction of the matmul rate measured in the run.
The chunk chosen is the smallest T whose efficiency is within `within` of the best measured: a
larger chunk then buys under (1 - within) of GEMM throughput, and costs the decodes that share
its step (mixed steps) the whole of its time.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from contract.job import Shape
from engine_templates.engine.config import ModelConfig
from engine_templates.ops.fused_moe import OP as FUSED_MOE

TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)
WITHIN = 0.9  # the smallest chunk within 10% of the best efficiency


def layer_flops(cfg: ModelConfig, tokens: int) -> int:
    """The FLOPs of one layer's GEMMs at `tokens` tokens (a MoE layer's experts at top-k a token)."""
    h, hd = cfg.hidden, cfg.head_dim
    attn = (cfg.heads + 2 * cfg.kv_heads) * hd * h + h * cfg.heads * hd
    if cfg.is_moe:
        mlp = cfg.experts * h + cfg.experts_per_token * 3 * cfg.moe_intermediate * h
    else:
        mlp = 3 * cfg.intermediate * h
    return 2 * tokens * (attn + mlp)


def layer_gemms(cfg: ModelConfig, tokens: int, dtype: torch.dtype, device: str):
    """A function running one layer's GEMMs at `tokens` tokens on random inputs of the model's shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    h, hd = cfg.hidden, cfg.head_dim

    def w(*shape):
        return (torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5).to(dtype)

    x = w(tokens, h)
    qkv, o = w((cfg.heads + 2 * cfg.kv_heads) * hd, h), w(h, cfg.heads * hd)
    attn_out = w(tokens, cfg.heads * hd)
    if cfg.is_moe:
        shape = Shape(f"prefill_{tokens}", {"tokens": tokens, "hidden": h, "inter": cfg.moe_intermediate,
                                            "experts": cfg.experts, "top_k": cfg.experts_per_token})
        _, logits, w_gate_up, w_down, top_k, renorm = FUSED_MOE.inputs(shape, dtype, device, gen, "normal")
        router = w(cfg.experts, h)

        def mlp():
            F.linear(x, router)
            return FUSED_MOE.eager(x, logits, w_gate_up, w_down, top_k, renorm)
    else:
        gate_up, down = w(2 * cfg.intermediate, h), w(h, cfg.intermediate)
        act = w(tokens, cfg.intermediate)

        def mlp():
            F.linear(x, gate_up)
            return F.linear(act, down)

    def run():
        F.linear(x, qkv)
        F.linear(attn_out, o)
        return mlp()

    return run


def median_us(fn, device: str, reps: int = 10) -> float:
    """Median wall time of a call, between device synchronisations, after two warm-up calls."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def sweep(cfg: ModelConfig, dtype: torch.dtype, device: str, matmul_flops_per_s: float,
          tokens=TOKENS, timer=median_us) -> list[dict]:
    """[{tokens, us, efficiency}] per token count: one layer's GEMMs timed by `timer(fn, device)`."""
    points = []
    for t in tokens:
        us = timer(layer_gemms(cfg, t, dtype, device), device)
        points.append({"tokens": t, "us": us, "efficiency": layer_flops(cfg, t) / (us * 1e-6) / matmul_flops_per_s})
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return points


def choose(points: list[dict], within: float = WITHIN) -> int:
    """The smallest token count whose efficiency is at least `within` of the best's."""
    best = max(p["efficiency"] for p in points)
    return min(p["tokens"] for p in points if p["efficiency"] >= within * best)
