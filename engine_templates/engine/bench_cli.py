"""`engine bench` and `engine profile`: their options and commands (engine_templates/engine/cli.py
adds them to its parser). Nothing heavy is imported until a command runs."""
from __future__ import annotations

from pathlib import Path


def add_bench_commands(sub) -> None:
    """Adds `bench` and `profile` to an argparse subparsers object (each sets `engine_fn`)."""
    b = sub.add_parser("bench", help="time the engine and HF transformers generate on random weights "
                                     "of model presets or configs; markdown and JSON to --out")
    b.add_argument("--out", required=True, type=Path, help="directory for engine_bench.md and .json")
    b.add_argument("--presets", "--models", dest="presets", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"],
                   help="model presets, or models' config.json files (or their directories): the random weights' "
                        "architecture and shape (default qwen3-8b qwen3-30b-a3b)")
    b.add_argument("--kernels", action="append", help="an engine variant: a kernels file, or `eager` "
                   "(every op's PyTorch baseline); repeatable (default: eager)")
    b.add_argument("--skip-hf", action="store_true", help="no HF transformers baseline or agreement check")
    b.add_argument("--enforce-eager", action="store_true", help="time the engine without CUDA graphs")
    b.add_argument("--no-async-decode", dest="async_decode", action="store_false",
                   help="time the engine reading each decode step's tokens before queuing the next")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="default bf16")
    b.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    b.add_argument("--decode-tokens", type=int, default=128, help="engine batch-1 decode tokens")
    b.add_argument("--hf-decode-tokens", type=int, default=32, help="HF batch-1 decode tokens")
    b.add_argument("--ttft-lengths", type=int, nargs="+", default=[512, 2048])
    b.add_argument("--ttft-reps", type=int, default=3, help="timed prompts per length (median)")
    b.add_argument("--concurrency", type=int, default=32)
    b.add_argument("--concurrent-prompt", type=int, default=128, help="prompt tokens of each concurrent request")
    b.add_argument("--concurrent-tokens", type=int, default=128, help="engine output tokens per request")
    b.add_argument("--hf-concurrent-tokens", type=int, default=32, help="HF output tokens per request")
    b.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared with HF")
    b.add_argument("--phase-seconds", type=float, default=20.0,
                   help="a decode phase stops after this long and reports what it made")
    b.add_argument("--decode-contexts", type=int, nargs="+", default=[],
                   help="also time the engine's batch-1 decode after a prompt of each of these lengths, e.g. 32768 "
                        "(its roofline counts the KV cache read)")
    b.add_argument("--fp8", action="store_true", help="time each kernels variant also with FP8 weights (quantized "
                                                      "at load, judged against HF on the bf16 weights)")
    b.add_argument("--spec-tokens", type=int, default=0, help="time each variant also with speculative decoding of "
                                                             "this many draft tokens (prompt lookup)")
    b.add_argument("--spec-ngram", type=int, default=3, help="the longest n-gram looked up (with --spec-tokens)")
    b.add_argument("--tolerance", type=float, help="nats, more than 0: how far the engine's log-probabilities "
                   "may be from HF's (default 0.25 in bf16/fp16, 1e-3 in fp32, 0.5 with FP8 weights)")
    b.add_argument("--seed", type=int, default=0, help="the random weights' seed (as `random-checkpoint --seed`)")
    b.add_argument("--serving", type=Path, help="a serving file (as `serve-bench --serving`): each of its traffic "
                   "patterns also run in process on every engine variant, under the serve stage's metric names")
    b.add_argument("--profile", action="store_true", help="also profile each engine variant's prefill step at "
                   "every --ttft-lengths and a batch-1 decode step: time per op category (GEMM, attention, "
                   "norms, rope, MoE GEMMs, MoE routing, elementwise, other) and the launch gaps")
    b.add_argument("--chunk-sweep", action="store_true", help="choose each preset's prefill chunk (the step's "
                   "token budget, `--max-num-batched-tokens`) from a GEMM-efficiency sweep of one layer: the smallest "
                   "within 10%% of the best efficiency (default: the longest TTFT length, at least 2048)")
    b.add_argument("--moe-prefill", choices=["torch", "triton"], default="torch",
                   help="MoE calls of more than 64 tokens: torch (default) or triton (Triton grouped GEMMs; "
                        "`engine serve --moe-prefill`)")
    b.set_defaults(engine_fn=cmd_bench)
    f = sub.add_parser("profile", help="where one decode step's time goes on a GPU: step wall time with CUDA "
                                       "graphs, the device's busy time, the roofline, and an eager step's kernels")
    f.add_argument("--presets", "--models", dest="presets", default="qwen3-8b",
                   help="comma-separated model presets or config.json paths (default qwen3-8b)")
    f.add_argument("--kernels", type=Path, help="kernels file (default: every op's PyTorch baseline)")
    f.add_argument("--batches", default="1", help="comma-separated decode batch sizes (default 1)")
    f.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default 512)")
    f.add_argument("--steps", type=int, default=30, help="decode steps timed (default 30)")
    f.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    f.add_argument("--no-async-decode", dest="async_decode", action="store_false",
                   help="the graphed step without async decode: each step's tokens read before the next is queued")
    f.set_defaults(engine_fn=cmd_profile)


def cmd_bench(args) -> int:
    from engine_templates.engine.bench import EAGER, BenchOptions, Workload, run
    from engine_templates.engine.bench.serving import load_patterns
    from engine_templates.engine.config import EngineSetupError, pick_device
    from engine_templates.engine.kernels import parse_kernels_file

    variants = tuple(args.kernels or [EAGER])
    specs = {k: parse_kernels_file(Path(k)) for k in variants if k != EAGER}
    work = Workload(decode_tokens=args.decode_tokens, hf_decode_tokens=args.hf_decode_tokens,
                    ttft_lengths=tuple(args.ttft_lengths), ttft_reps=args.ttft_reps,
                    concurrency=args.concurrency, concurrent_prompt=args.concurrent_prompt,
                    concurrent_tokens=args.concurrent_tokens, hf_concurrent_tokens=args.hf_concurrent_tokens,
                    check_tokens=args.check_tokens, cap_s=args.phase_seconds,
                    decode_contexts=tuple(args.decode_contexts))
    opts = BenchOptions(presets=tuple(args.presets), out=args.out, work=work, kernels=variants,
                        dtype=args.dtype, device=pick_device(args.device), skip_hf=args.skip_hf,
                        enforce_eager=args.enforce_eager, async_decode=args.async_decode,
                        tolerance=args.tolerance, seed=args.seed, kernel_specs=specs, fp8=args.fp8,
                        spec_tokens=args.spec_tokens, spec_ngram=args.spec_ngram,
                        serving=load_patterns(args.serving) if args.serving else (), profile=args.profile,
                        moe_prefill=args.moe_prefill, chunk_sweep=args.chunk_sweep)
    try:
        opts.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, say
        raise EngineSetupError(f"--out {opts.out}: cannot make the directory: {e.strerror}") from None
    return run(opts)


def cmd_profile(args) -> int:
    from engine_templates.engine.bench.profile import run

    return run(args)
