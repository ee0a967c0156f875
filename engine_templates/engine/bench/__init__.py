"""`engine bench`: the engine against HF transformers `generate` on random weights of a preset's
shape, in one process, each figure also as a fraction of its weight-bytes roofline.

Per preset: random weights drawn on the device; transformers' model built around the same
tensors (no second copy, so a 61 GB model fits once); the copy bandwidth and matmul rate
measured in this run (engine_templates/ceilings.py). Then per engine variant (a kernels file, or
`eager`: every op's PyTorch baseline) the agreement check — CUDA graphs against
--enforce-eager, and both against HF — and the timed phases (measure.py); HF's phases after
the first variant. Each variant is freed before the next. A variant that fails is recorded with its error and the rest
go on. Writes engine_bench.json and engine_bench.md to the output directory.
"""
from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine_templates.engine.bench.measure import Workload, check, engine_phases, hf_phases
from engine_templates.engine.bench.report import markdown
from engine_templates.engine.bench.roofline import bounds, weight_bytes
from engine_templates.engine.config import DTYPES, EngineConfig, EngineSetupError, KernelSpec, ModelConfig
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.loader import random_weights
from engine_templates.models import PRESETS

EAGER = "eager"  # the variant with no kernels file
TOLERANCE = {"fp32": 1e-3, "fp16": 0.25, "bf16": 0.25}  # nats (see measure.vs_hf)


@dataclass(frozen=True)
class BenchOptions:
    presets: tuple[str, ...]
    out: Path
    work: Workload
    kernels: tuple[str, ...] = (EAGER,)  # `eager` or a kernels file, one engine variant each
    dtype: str = "bf16"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    skip_hf: bool = False
    enforce_eager: bool = False  # no CUDA graphs in the timed engine either
    async_decode: bool = True  # EngineConfig.async_decode of the timed engine
    tolerance: float | None = None  # default: TOLERANCE[dtype]
    block_size: int = 16
    seed: int = 0
    kernel_specs: dict[str, dict[str, KernelSpec]] = field(default_factory=dict)  # file -> parsed

    def __post_init__(self):
        unknown = [p for p in self.presets if p not in PRESETS]
        if unknown or not self.presets:
            raise EngineSetupError(f"--presets: unknown presets {unknown}; known: {', '.join(PRESETS)}")
        if self.dtype not in DTYPES:
            raise EngineSetupError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise EngineSetupError(f"--tolerance must be more than 0 nats, not {self.tolerance}")
        if not self.kernels or any(k != EAGER and k not in self.kernel_specs for k in self.kernels):
            raise ValueError("every kernels variant must be `eager` or a parsed kernels file")


_START = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _free(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _engine_config(opts: BenchOptions, variant: str, **extra) -> EngineConfig:
    w = opts.work
    length = -(-w.max_len() // opts.block_size) * opts.block_size
    per_seq = -(-(w.concurrent_prompt + w.concurrent_tokens) // opts.block_size)
    blocks = max(w.concurrency * per_seq, length // opts.block_size) + w.concurrency
    settings = dict(model_dir=None, dtype=opts.dtype, device=opts.device, block_size=opts.block_size,
                    max_num_seqs=w.concurrency, max_model_len=length, num_kv_blocks=blocks,
                    max_num_batched_tokens=max(2048, max(w.ttft_lengths)),
                    kernels=opts.kernel_specs.get(variant, {}), enforce_eager=opts.enforce_eager,
                    async_decode=opts.async_decode, seed=opts.seed)
    settings.update(extra)
    return EngineConfig(**settings)


def _engine_variant(opts: BenchOptions, variant: str, cfg: ModelConfig, weights, oracle) -> dict:
    engine, graphs_error = None, None
    try:
        engine = LLMEngine(_engine_config(opts, variant), cfg, weights)
    except Exception as e:
        if opts.enforce_eager or torch.device(opts.device).type != "cuda":
            raise
        # Graph capture is the part never run on a GPU before: without it there are still numbers.
        traceback.print_exc()
        graphs_error = f"{type(e).__name__}: {e}"
    if engine is None:  # outside the except block, so the failed engine's frames are gone
        _log(f"  CUDA graphs failed ({graphs_error}); measuring with --enforce-eager")
        _free(opts.device)
        engine = LLMEngine(_engine_config(opts, variant, enforce_eager=True), cfg, weights)
    work = opts.work
    small = dict(enforce_eager=True, max_num_seqs=work.check_prompts, num_kv_blocks=work.check_prompts * (
        -(-(work.check_prompt_len + work.check_tokens) // opts.block_size)) + 1)
    eager = LLMEngine(_engine_config(opts, variant, **small), cfg, weights)
    tol = opts.tolerance if opts.tolerance is not None else TOLERANCE[opts.dtype]
    result = {"kernels": engine.kernel_choices, "config": _config_summary(engine.config),
              "graph_batch_sizes": engine.runner.graphs.sizes if engine.runner.graphs else [],
              "graphs_error": graphs_error,
              "check": check(engine, eager, oracle, work, cfg.vocab, opts.seed, tol)}
    del eager
    _free(opts.device)
    c = result["check"]
    _log(f"  agreement: {'ok' if c['agree'] else 'NOT OK'} "
         f"(graphs: {c['graphs']}, graphs vs eager tokens equal: {c['graphs_vs_eager']['tokens_equal']}"
         + (f", vs HF: gap {c['engine_vs_hf']['worst_gap_to_hf_argmax']:.3g}, "
            f"logprob diff {c['engine_vs_hf']['max_logprob_diff']:.3g}" if "engine_vs_hf" in c else "") + ")")
    result["metrics"] = engine_phases(engine, work, cfg.vocab, opts.seed, _log)
    return result


def _config_summary(config: EngineConfig) -> dict:
    return {k: v for k, v in asdict(config).items() if k not in ("model_dir", "kernels")}


def _run_system(fn, device: str) -> dict:
    """One system's results, or its error: recorded, printed in full, and the run goes on."""
    try:
        return fn()
    except Exception as e:  # a failing variant must not lose the others' numbers
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        _free(device)


def _hf_system(opts: BenchOptions, cfg: ModelConfig, oracle) -> dict:
    import transformers

    return {"transformers": transformers.__version__,
            "attn_implementation": oracle.model.config._attn_implementation,
            "experts_implementation": getattr(oracle.model.config, "_experts_implementation", None),
            "metrics": hf_phases(oracle.model, opts.work, cfg.vocab, opts.seed, _log)}


def run_preset(opts: BenchOptions, preset: str, ceilings: dict, save) -> dict:
    """The preset's figures; `save(partial)` after each system, so a run cut short keeps them."""
    cfg = ModelConfig.from_preset(PRESETS[preset])
    dtype = DTYPES[opts.dtype]
    _log(f"{preset}: random weights on {opts.device}")
    weights = random_weights(cfg, dtype, opts.device, opts.seed)
    out = {"model": {"weight_bytes_decode_b1": weight_bytes(cfg, 1, dtype.itemsize),
                     "moe": cfg.is_moe},
           "roofline": bounds(cfg, dtype.itemsize, ceilings["copy_bytes_per_s"],
                              ceilings["matmul_flops_per_s"], list(opts.work.ttft_lengths),
                              opts.work.concurrency),
           "systems": {}}
    oracle = None
    if not opts.skip_hf:
        from engine_templates.engine.oracle import HFOracle

        oracle = HFOracle.sharing(cfg, weights)
    # HF right after the first variant: a later one with kernels never run on this GPU could
    # take the CUDA context, and everything after it, down with an illegal memory access.
    order = [opts.kernels[0]] + (["hf"] if oracle is not None else []) + list(opts.kernels[1:])
    for system in order:
        name = "hf" if system == "hf" else "engine" if system == EAGER else f"engine+{Path(system).name}"
        _log(f"{preset}: {name}")
        if system == "hf":
            out["systems"][name] = _run_system(lambda: _hf_system(opts, cfg, oracle), opts.device)  # noqa: F821 (deleted below, after the lambda ran)
        else:
            out["systems"][name] = _run_system(lambda: _engine_variant(opts, system, cfg, weights, oracle),  # noqa: F821 (deleted below, after the lambda ran)
                                               opts.device)
        save(out)
    del oracle, weights
    _free(opts.device)
    return out


def device_info(device: str) -> dict:
    import triton

    info = {"device": device, "torch": torch.__version__, "triton": triton.__version__}
    if torch.device(device).type == "cuda":
        info.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    else:
        info["name"] = "cpu"
    return info


def run(opts: BenchOptions) -> int:
    """Runs every preset, writes the JSON and the markdown; 1 if any system failed."""
    from engine_templates.ceilings import measure

    opts.out.mkdir(parents=True, exist_ok=True)
    info = device_info(opts.device)
    _log(f"device: {info['name']}; measuring copy bandwidth and matmul rate")
    ceilings = measure(torch.device(opts.device).type, opts.dtype)
    _free(opts.device)
    _log(f"copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
         f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s")
    result = {"device": info, "ceilings": ceilings, "dtype": opts.dtype,
              "workload": asdict(opts.work), "presets": {}}

    def save(preset: str, partial: dict) -> None:
        result["presets"][preset] = partial
        # default=str: a version string or setting of an unexpected type must not lose the run
        (opts.out / "engine_bench.json").write_text(json.dumps(result, indent=1, default=str))
        (opts.out / "engine_bench.md").write_text(markdown(result))

    for preset in opts.presets:
        run_preset(opts, preset, ceilings, lambda partial: save(preset, partial))
    _log(f"wrote {opts.out / 'engine_bench.md'} and engine_bench.json")
    failed = [f"{p}/{s}" for p, r in result["presets"].items() for s, v in r["systems"].items() if "error" in v]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
