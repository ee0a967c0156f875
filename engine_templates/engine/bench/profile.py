"""`engine profile`: where one decode step's time goes, on random weights of a preset.

Three numbers per batch size, each per step: the wall time of `LLMEngine.step()` with CUDA
graphs (what `engine bench` times), the device's busy time in that step (the sum of its
kernels' durations, from the profiler), and the bytes roofline (the weights, and every
sequence's KV cache at --context). Then the kernels of an
eager step (no graphs, so each kernel is named), grouped by name: calls and time per step.
Wall minus busy is the host's share (scheduling, sampling, the token's copy back) — with async
decode (the default; --no-async-decode for without) what of it the device's work does not hide;
busy minus roofline is the kernels' own inefficiency — the table says which.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

from engine_templates.ceilings import measure
from engine_templates.engine.bench.roofline import kv_bytes, weight_bytes
from engine_templates.engine.config import EngineConfig, ModelConfig
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.kernels import parse_kernels_file
from engine_templates.engine.loader import random_weights
from engine_templates.engine.sequence import SamplingParams
from engine_templates.hf_config import ConfigError, model_dims


def _engine(cfg: ModelConfig, weights, kernels, batch: int, context: int, steps: int, eager: bool,
            async_decode: bool = True) -> LLMEngine:
    length = context + 3 * steps + 16  # room for every step of _start, _wall_us and _kernels
    blocks = batch * (-(-length // 16)) + 1
    return LLMEngine(EngineConfig(model_dir=None, device="cuda", max_num_seqs=batch, max_model_len=length,
                                  num_kv_blocks=blocks, kernels=kernels, enforce_eager=eager,
                                  async_decode=async_decode, cuda_graph_batch_sizes=(batch,)), cfg, weights)


def _start(engine: LLMEngine, cfg: ModelConfig, batch: int, context: int, steps: int) -> None:
    """`batch` sequences of `context` random tokens, prefilled and three steps into decoding."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        prompt = torch.randint(0, cfg.vocab, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=3 * steps + 8, ignore_eos=True))
    while any(s.num_completion_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()


def _kernels(engine: LLMEngine, steps: int) -> tuple[dict[str, list[float]], float]:
    """{kernel name: [calls, device us]} over `steps` steps, and the host wall us per step."""
    from time import perf_counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (perf_counter() - t) / steps * 1e6
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            entry = by_name[e.name]
            entry[0] += 1
            entry[1] += e.device_time  # us
    return by_name, wall


def _wall_us(engine: LLMEngine, steps: int) -> float:
    from time import perf_counter

    torch.cuda.synchronize()
    t = perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (perf_counter() - t) / steps * 1e6


def profile_preset(preset: str, kernels_file: Path | None, batches: list[int], context: int, steps: int,
                   top: int, out=None, async_decode: bool = True) -> None:
    if out is None:  # looked up at the call: a redirected or captured stdout gets the report
        out = sys.stdout
    cfg = ModelConfig.from_preset(model_dims(preset))
    kernels = parse_kernels_file(kernels_file) if kernels_file else {}
    weights = random_weights(cfg, torch.bfloat16, "cuda")
    copy_gbs = measure("cuda")["copy_bytes_per_s"] / 1e9
    print(f"## {preset}: {torch.cuda.get_device_name()}, kernels {kernels_file or 'eager'}, context {context}, "
          f"copy bandwidth {copy_gbs:.0f} GB/s, async decode {'on' if async_decode else 'off'}", file=out)
    for batch in batches:
        # the weights once, and each sequence's KV cache at its context
        roof_us = (weight_bytes(cfg, batch, 2) + batch * kv_bytes(cfg, context, 2)) / (copy_gbs * 1e9) * 1e6
        graphed = _engine(cfg, weights, kernels, batch, context, steps, eager=False, async_decode=async_decode)
        _start(graphed, cfg, batch, context, steps)
        wall = _wall_us(graphed, steps)
        busy_names, _ = _kernels(graphed, steps)
        busy = sum(t for _, t in busy_names.values()) / steps
        del graphed
        torch.cuda.empty_cache()
        eager = _engine(cfg, weights, kernels, batch, context, steps, eager=True)
        _start(eager, cfg, batch, context, steps)
        names, eager_wall = _kernels(eager, steps)
        del eager
        torch.cuda.empty_cache()
        eager_busy = sum(t for _, t in names.values()) / steps
        print(f"\n### batch {batch}: step {wall:.0f} us with graphs ({roof_us / wall:.1%} of the roofline "
              f"{roof_us:.0f} us); device busy {busy:.0f} us of it ({roof_us / busy:.1%} of the roofline); "
              f"eager step {eager_wall:.0f} us, its kernels {eager_busy:.0f} us\n", file=out)
        print("| kernel (eager step) | calls/step | us/step | share |\n| --- | ---: | ---: | ---: |", file=out)
        ranked = sorted(names.items(), key=lambda kv: -kv[1][1])
        for name, (calls, us) in ranked[:top]:
            print(f"| `{name[:90]}` | {calls / steps:.0f} | {us / steps:.1f} | {us / steps / eager_busy:.1%} |",
                  file=out)
        rest = ranked[top:]
        if rest:
            print(f"| {len(rest)} others | {sum(c for _, (c, _) in rest) / steps:.0f} | "
                  f"{sum(u for _, (_, u) in rest) / steps:.1f} | "
                  f"{sum(u for _, (_, u) in rest) / steps / eager_busy:.1%} |", file=out)
        out.flush()
    del weights
    torch.cuda.empty_cache()


def run(args) -> int:
    """`engine profile` (engine_templates/engine/cli.py has the options)."""
    presets = [s for s in args.presets.split(",") if s]
    for model in presets:
        try:
            model_dims(model)
        except ConfigError as e:
            print(f"engine profile: --presets: {e}", file=sys.stderr)
            return 2
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        print(f"engine profile: --batches must be comma-separated positive integers, not {args.batches!r}",
              file=sys.stderr)
        return 2
    for name in ("context", "steps", "top"):
        if getattr(args, name) < 1:
            print(f"engine profile: --{name} must be at least 1", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("engine profile: needs a CUDA GPU (it profiles device kernels)", file=sys.stderr)
        return 2
    for preset in presets:  # a bad kernels file is an EngineSetupError: one line from the CLI
        profile_preset(preset, args.kernels, batches, args.context, args.steps, args.top,
                       async_decode=args.async_decode)
    return 0
