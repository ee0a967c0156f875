"""`engine bench`: the engine against HF transformers `generate` on random weights of a preset's
shape, in one process, each figure also as a fraction of its weight-bytes roofline.

Per preset: random weights drawn on the device; transformers' model built around the same
tensors (no second copy, so a 61 GB model fits once); the copy bandwidth and matmul rate
measured in this run (engine_templates/ceilings.py). Then per engine variant (a kernels file, or
`eager`: every op's PyTorch baseline; with --fp8 each also with FP8 weights quantized at load, a
second copy of the matrices at half their size; with --spec-tokens each also with speculative
decoding, whose acceptance on random weights says little: docs/engine-fp8-speculative.md) the
agreement check — CUDA graphs against
--enforce-eager, and both against HF — and the timed phases (measure.py); HF's phases after
the first variant. Each variant is freed before the next. A variant that fails is recorded with its error and the rest
go on. With --chunk-sweep, every variant's prefill chunk (its step token budget) is the one a GEMM-efficiency
sweep chooses (chunk.py). With --profile, each variant's prefill step at every TTFT length and a batch-1 decode step
are also profiled per op category (op_profile.py). Writes engine_bench.json and engine_bench.md to
the output directory.
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

from contract.serve import Pattern
from engine_templates.engine.bench import chunk, serving
from engine_templates.engine.bench.measure import Workload, check, engine_phases, hf_phases, sync
from engine_templates.engine.bench.op_profile import profile_engine
from engine_templates.engine.bench.report import markdown
from engine_templates.engine.bench.roofline import bounds, weight_bytes
from engine_templates.engine.config import DTYPES, EngineConfig, EngineSetupError, KernelSpec, ModelConfig
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.loader import random_weights
from engine_templates.hf_config import ConfigError, model_dims
from engine_templates.models import PRESETS

EAGER = "eager"  # the variant with no kernels file
TOLERANCE = {"fp32": 1e-3, "fp16": 0.25, "bf16": 0.25}  # nats (see measure.vs_hf)
FP8_TOLERANCE = 0.5  # nats: FP8 weights against HF on the bf16 ones (the fp8 target's threshold)


@dataclass(frozen=True)
class Variant:
    """One engine to time: a kernels file (or `eager`), FP8 weights or not, speculation or not."""

    kernels: str = EAGER
    fp8: bool = False
    spec_tokens: int = 0

    @property
    def name(self) -> str:
        return ("engine" + ("" if self.kernels == EAGER else f"+{Path(self.kernels).name}")
                + ("+fp8" if self.fp8 else "") + (f"+spec{self.spec_tokens}" if self.spec_tokens else ""))


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
    fp8: bool = False  # each kernels variant also with FP8 weights (quantized at load)
    spec_tokens: int = 0  # each variant also with speculative decoding, this many draft tokens
    spec_ngram: int = 3
    serving: tuple[Pattern, ...] = ()  # a serving file's patterns, each also run in process (serving.py)
    moe_prefill: str = "torch"  # EngineConfig.moe_prefill of every variant
    chunk_sweep: bool = False  # the prefill chunk of every variant from a GEMM-efficiency sweep (chunk.py)
    profile: bool = False  # each engine variant's prefill and decode steps profiled per op category (op_profile.py)

    @property
    def variants(self) -> list[Variant]:
        return [Variant(k, fp8, spec) for k in self.kernels for fp8 in ((False, True) if self.fp8 else (False,))
                for spec in ((0, self.spec_tokens) if self.spec_tokens else (0,))]

    def __post_init__(self):
        if not self.presets:
            raise EngineSetupError(f"--presets: name at least one model (presets: {', '.join(PRESETS)})")
        for model in self.presets:
            try:
                model_dims(model)
            except ConfigError as e:
                raise EngineSetupError(f"--presets: {e}") from None
        if self.dtype not in DTYPES:
            raise EngineSetupError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise EngineSetupError(f"--tolerance must be more than 0 nats, not {self.tolerance}")
        if not self.kernels or any(k != EAGER and k not in self.kernel_specs for k in self.kernels):
            raise ValueError("every kernels variant must be `eager` or a parsed kernels file")
        if self.spec_tokens < 0 or self.spec_ngram < 1:
            raise EngineSetupError(f"--spec-tokens must be at least 0 and --spec-ngram at least 1, not "
                                   f"{self.spec_tokens} and {self.spec_ngram}")


_START = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _free(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _engine_config(opts: BenchOptions, variant: Variant, **extra) -> EngineConfig:
    w = opts.work
    longest = max([w.max_len()] + [serving.longest(p) for p in opts.serving])
    length = -(-(longest + variant.spec_tokens) // opts.block_size) * opts.block_size
    per_seq = -(-(w.concurrent_prompt + w.concurrent_tokens + variant.spec_tokens) // opts.block_size)
    seqs = max([w.concurrency] + [serving.in_flight(p) for p in opts.serving])
    need = [-(-(serving.longest(p) + variant.spec_tokens) // opts.block_size) * serving.in_flight(p)
            for p in opts.serving]
    blocks = max([w.concurrency * per_seq, length // opts.block_size] + need) + seqs
    settings = dict(model_dir=None, dtype=opts.dtype, device=opts.device, block_size=opts.block_size,
                    max_num_seqs=seqs, max_model_len=length, num_kv_blocks=blocks,
                    max_num_batched_tokens=max(2048, max(w.ttft_lengths)),
                    kernels=opts.kernel_specs.get(variant.kernels, {}), enforce_eager=opts.enforce_eager,
                    async_decode=opts.async_decode, seed=opts.seed, quantization="fp8" if variant.fp8 else "",
                    spec_tokens=variant.spec_tokens, spec_ngram=opts.spec_ngram, moe_prefill=opts.moe_prefill)
    settings.update(extra)
    return EngineConfig(**settings)


def _engine_variant(opts: BenchOptions, variant: Variant, cfg: ModelConfig, weights, oracle, ceilings,
                    chunk_sweep: dict | None = None) -> dict:
    engine, graphs_error = None, None
    budget = {} if chunk_sweep is None else {"max_num_batched_tokens": chunk_sweep["chosen"]}
    try:
        engine = LLMEngine(_engine_config(opts, variant, **budget), cfg, weights)
    except Exception as e:
        if opts.enforce_eager or torch.device(opts.device).type != "cuda":
            raise
        # Graph capture is the part never run on a GPU before: without it there are still numbers.
        traceback.print_exc()
        graphs_error = f"{type(e).__name__}: {e}"
    if engine is None:  # outside the except block, so the failed engine's frames are gone
        _log(f"  CUDA graphs failed ({graphs_error}); measuring with --enforce-eager")
        _free(opts.device)
        engine = LLMEngine(_engine_config(opts, variant, enforce_eager=True, **budget), cfg, weights)
    work = opts.work
    small = dict(enforce_eager=True, max_num_seqs=work.check_prompts, num_kv_blocks=work.check_prompts * (
        -(-(work.check_prompt_len + work.check_tokens) // opts.block_size)) + 1)
    eager = LLMEngine(_engine_config(opts, variant, **small), cfg, weights)
    tol = opts.tolerance if opts.tolerance is not None else FP8_TOLERANCE if variant.fp8 else TOLERANCE[opts.dtype]
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
    if opts.serving:
        result["serving"] = {}
        for p in opts.serving:
            result["serving"][p.name] = got = serving.measure_pattern(engine, p, cfg.vocab, opts.seed,
                                                                      lambda: sync(opts.device))
            _log(f"  serving pattern {p.name}: {got['output_tps']:.4g} output tok/s, "
                 f"TTFT p50 {got['ttft_p50_ms']:.4g} ms ({got['requests']} requests)")
    if opts.profile:
        _log("  profiling a prefill step at each TTFT length and a batch-1 decode step")
        result["profile"] = profile_engine(engine, work.ttft_lengths, work.decode_prompt, cfg.vocab, opts.seed)
    if variant.fp8:  # its own roofline: the matrices are read at one byte a parameter
        result["roofline"] = _bounds(opts, cfg, ceilings, matrix_itemsize=1)
        result["fp8"] = engine.kernel_choices["fp8"]
        if engine.runner.model.moe_fp8 is not None:  # calls from Python: prefills, warm-ups, captures
            result["fp8"]["moe_calls"] = dict(engine.runner.model.moe_fp8.calls)
    if engine.runner.model.moe_prefill is not None:  # its calls by now, and a refusal since the start
        result["kernels"]["moe_prefill"] = engine.runner.model.moe_prefill.choices()
    if variant.spec_tokens:  # every phase's drafts together, warm-ups included
        result["speculative"] = engine.spec_stats.as_dict()
    return result


def _bounds(opts: BenchOptions, cfg: ModelConfig, ceilings: dict, matrix_itemsize: float | None = None) -> dict:
    w = opts.work
    return bounds(cfg, DTYPES[opts.dtype].itemsize, ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"],
                  list(w.ttft_lengths), w.concurrency, decode_context=w.decode_prompt + w.decode_tokens / 2,
                  concurrent_context=w.concurrent_prompt + w.concurrent_tokens / 2,
                  long_contexts=w.decode_contexts, decode_tokens=w.decode_tokens, matrix_itemsize=matrix_itemsize)


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
    cfg = ModelConfig.from_preset(model_dims(preset))
    dtype = DTYPES[opts.dtype]
    _log(f"{preset}: random weights on {opts.device}")
    weights = random_weights(cfg, dtype, opts.device, opts.seed)
    out = {"model": {"weight_bytes_decode_b1": weight_bytes(cfg, 1, dtype.itemsize),
                     "moe": cfg.is_moe},
           "roofline": _bounds(opts, cfg, ceilings),
           "systems": {}}
    if opts.chunk_sweep:
        _log(f"{preset}: GEMM-efficiency sweep for the prefill chunk")
        points = chunk.sweep(cfg, dtype, opts.device, ceilings["matmul_flops_per_s"])
        out["chunk_sweep"] = {"points": points, "within": chunk.WITHIN, "chosen": chunk.choose(points)}
        _log(f"  prefill chunk {out['chunk_sweep']['chosen']} tokens: " + ", ".join(
            f"{p['tokens']}: {p['efficiency']:.0%}" for p in points))
        _free(opts.device)
    oracle = None
    if not opts.skip_hf:
        from engine_templates.engine.oracle import HFOracle

        oracle = HFOracle.sharing(cfg, weights)
    # HF right after the first variant: a later one with kernels never run on this GPU could
    # take the CUDA context, and everything after it, down with an illegal memory access.
    variants = opts.variants
    order = variants[:1] + (["hf"] if oracle is not None else []) + variants[1:]
    for system in order:
        name = "hf" if system == "hf" else system.name
        _log(f"{preset}: {name}")
        if system == "hf":
            out["systems"][name] = _run_system(lambda: _hf_system(opts, cfg, oracle), opts.device)  # noqa: F821 (deleted below, after the lambda ran)
        else:
            out["systems"][name] = _run_system(
                lambda: _engine_variant(opts, system, cfg, weights, oracle, ceilings,  # noqa: F821 (deleted below)
                                        out.get("chunk_sweep")),
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
              "workload": asdict(opts.work), "serving": [asdict(p) for p in opts.serving], "presets": {}}

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
