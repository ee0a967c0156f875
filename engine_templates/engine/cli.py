"""`engine generate`, `engine serve`, `engine serve-reference`, `engine bench`, `engine profile`
and `engine random-checkpoint`: shared by `infersmith engine ...` and, on a GPU host
without the controller's packages, `python -m engine_templates.engine ...`.

Nothing heavy is imported until a command runs: `infersmith` builds this parser for every
command, and importing torch costs seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def add_commands(sub) -> None:
    """Adds `generate`, `serve`, `serve-reference`, `bench`, `profile` and `random-checkpoint` to an argparse
    subparsers object (each sets `engine_fn`)."""
    g = sub.add_parser("generate", help="complete prompts with a model directory and print the text")
    _add_engine_options(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, help="per-request seed for sampled decoding")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens even past an end-of-sequence token")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt: text, "
                                                        "token ids, log-probabilities, kernels")
    g.set_defaults(engine_fn=cmd_generate)
    s = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    _add_engine_options(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000, help="0: any free port (printed)")
    s.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    s.add_argument("--request-log", action="store_true",
                   help="one line per finished request on stderr: prompt and generated tokens, and the ms after "
                        "it arrived at which it was handed to the engine, taken by it, had its first token, and ended")
    s.set_defaults(engine_fn=cmd_serve)
    r = sub.add_parser("serve-reference", help="serve a model directory through HF transformers (greedy, one "
                                               "request at a time): the accuracy reference and speed baseline")
    r.add_argument("--model-dir", required=True, type=Path)
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="default bf16")
    r.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    r.add_argument("--max-model-len", type=int, default=4096, help="tokens of a sequence, prompt and "
                                                                    "completion (default 4096)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=_port, default=8000, help="0: any free port (printed)")
    r.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    r.set_defaults(engine_fn=cmd_serve_reference)
    b = sub.add_parser("bench", help="time the engine and HF transformers generate on random weights "
                                     "of model presets; markdown and JSON to --out")
    b.add_argument("--out", required=True, type=Path, help="directory for engine_bench.md and .json")
    b.add_argument("--presets", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"])
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
    b.add_argument("--tolerance", type=float, help="nats, more than 0: how far the engine's log-probabilities "
                   "may be from HF's (default 0.25 in bf16/fp16, 1e-3 in fp32)")
    b.add_argument("--seed", type=int, default=0, help="the random weights' seed (as `random-checkpoint --seed`)")
    b.set_defaults(engine_fn=cmd_bench)
    f = sub.add_parser("profile", help="where one decode step's time goes on a GPU: step wall time with CUDA "
                                       "graphs, the device's busy time, the roofline, and an eager step's kernels")
    f.add_argument("--presets", default="qwen3-8b", help="comma-separated model presets (default qwen3-8b)")
    f.add_argument("--kernels", type=Path, help="kernels file (default: every op's PyTorch baseline)")
    f.add_argument("--batches", default="1", help="comma-separated decode batch sizes (default 1)")
    f.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default 512)")
    f.add_argument("--steps", type=int, default=30, help="decode steps timed (default 30)")
    f.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    f.add_argument("--no-async-decode", dest="async_decode", action="store_false",
                   help="the graphed step without async decode: each step's tokens read before the next is queued")
    f.set_defaults(engine_fn=cmd_profile)
    c = sub.add_parser("random-checkpoint", help="write an HF-format model directory with random bf16 "
                                                 "weights at a preset's shape and a tokenizer for them")
    c.add_argument("--preset", required=True, help="the model preset whose shape it has, e.g. qwen3-8b")
    c.add_argument("--out", required=True, type=Path, help="the model directory to write")
    c.add_argument("--seed", type=int, default=0, help="the weights' seed (`engine bench --seed` draws the same)")
    c.add_argument("--device", help="where the weights are drawn: cuda or cpu (default: cuda when available)")
    c.add_argument("--layers", type=int, help="this many layers instead of the preset's (a small "
                                              "checkpoint of the real width)")
    c.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing its "
                                                        "config, tokenizer and safetensors files")
    c.set_defaults(engine_fn=cmd_random_checkpoint)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, type=Path, help="HF-format directory: config.json, "
                   "*.safetensors, tokenizer.json")
    p.add_argument("--kernels", type=Path, help="JSON file choosing each op's implementation "
                                                "(default: every op eager)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="default bf16")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=4096, help="tokens of a sequence, prompt and "
                                                                    "completion, at least 1 (default 4096)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one batch, at least 1 (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step that has a prompt chunk (a mixed step's decode tokens "
                        "included); longer prompts are chunked")
    p.add_argument("--no-mixed-steps", dest="mixed_steps", action="store_false",
                   help="never run decodes and prompt chunks in one step: decodes wait while any "
                        "prompt has tokens left")
    p.add_argument("--no-async-decode", dest="async_decode", action="store_false",
                   help="read each decode step's tokens before queuing the next (default: the next "
                        "decode step is queued first, so the host's work overlaps the device's)")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="KV-cache blocks (default 0: as many as memory "
                                                                 "allows)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cuda-graph-batch-sizes", default="1,2,4,8,16,32,64",
                   help="decode batch sizes captured as CUDA graphs, comma-separated")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--seed", type=int, default=0, help="the engine's random generator: sampled tokens of "
                                                         "requests without their own seed")


def engine_config(args):
    """Validates the model directory (one-line EngineSetupError) before anything heavy loads."""
    from engine_templates.engine.config import EngineConfig, EngineSetupError, ModelConfig, pick_device
    from engine_templates.engine.kernels import parse_kernels_file

    ModelConfig.from_dir(args.model_dir)
    kernels = parse_kernels_file(args.kernels) if args.kernels else {}
    device = pick_device(args.device)
    try:
        graph_sizes = tuple(int(b) for b in args.cuda_graph_batch_sizes.split(","))
    except ValueError:
        raise EngineSetupError(f"--cuda-graph-batch-sizes: expected integers separated by commas, "
                               f"got {args.cuda_graph_batch_sizes!r}") from None
    return EngineConfig(model_dir=args.model_dir, dtype=args.dtype, device=device, kernels=kernels,
                        cuda_graph_batch_sizes=graph_sizes, block_size=args.block_size,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        mixed_steps=args.mixed_steps, async_decode=args.async_decode,
                        num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager, seed=args.seed)


def cmd_generate(args) -> int:
    from engine_templates.engine.config import EngineSetupError
    from engine_templates.engine.engine import LLMEngine
    from engine_templates.engine.sequence import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.sampling_seed, max_tokens=args.max_tokens,
                                stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise EngineSetupError(str(e)) from None
    engine = LLMEngine(engine_config(args))
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    try:
        seqs = engine.generate(prompts, params)
    except ValueError as e:  # a prompt longer than the model allows
        raise EngineSetupError(str(e)) from None
    for seq in seqs:
        if args.json:
            print(json.dumps({"text": seq.text, "finish_reason": seq.finish_reason,
                              "prompt_token_ids": seq.token_ids[:seq.num_prompt_tokens],
                              "token_ids": seq.completion_token_ids, "logprobs": seq.logprobs,
                              "kernels": engine.kernel_choices}))
        else:
            print(seq.text)
    return 0


def cmd_serve(args) -> int:
    from engine_templates.engine.engine import LLMEngine
    from engine_templates.engine.server import check_listen, create_app, serve_app

    config = engine_config(args)
    check_listen(args.host, args.port)
    engine = LLMEngine(config)
    name = args.served_model_name or Path(args.model_dir).resolve().name
    app = create_app(engine, name, request_log=args.request_log)
    banner = lambda port: f"serving {name} on http://{args.host}:{port} (kernels: {json.dumps(engine.kernel_choices)})"
    try:
        asyncio.run(serve_app(app, args.host, args.port, banner))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_serve_reference(args) -> int:
    from engine_templates.engine.config import ModelConfig, at_least, pick_device
    from engine_templates.engine.reference_server import ReferenceState, serve
    from engine_templates.engine.server import check_listen

    ModelConfig.from_dir(args.model_dir)  # a bad directory is one line, before transformers loads
    device = pick_device(args.device)
    at_least("--max-model-len", args.max_model_len, 1)
    check_listen(args.host, args.port)
    name = args.served_model_name or Path(args.model_dir).resolve().name
    state = ReferenceState(args.model_dir, name, args.dtype, device, args.max_model_len)
    try:
        asyncio.run(serve(state, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_bench(args) -> int:
    from engine_templates.engine.bench import EAGER, BenchOptions, Workload, run
    from engine_templates.engine.config import EngineSetupError, pick_device
    from engine_templates.engine.kernels import parse_kernels_file

    variants = tuple(args.kernels or [EAGER])
    specs = {k: parse_kernels_file(Path(k)) for k in variants if k != EAGER}
    work = Workload(decode_tokens=args.decode_tokens, hf_decode_tokens=args.hf_decode_tokens,
                    ttft_lengths=tuple(args.ttft_lengths), ttft_reps=args.ttft_reps,
                    concurrency=args.concurrency, concurrent_prompt=args.concurrent_prompt,
                    concurrent_tokens=args.concurrent_tokens, hf_concurrent_tokens=args.hf_concurrent_tokens,
                    check_tokens=args.check_tokens, cap_s=args.phase_seconds)
    opts = BenchOptions(presets=tuple(args.presets), out=args.out, work=work, kernels=variants,
                        dtype=args.dtype, device=pick_device(args.device), skip_hf=args.skip_hf,
                        enforce_eager=args.enforce_eager, async_decode=args.async_decode,
                        tolerance=args.tolerance, seed=args.seed, kernel_specs=specs)
    try:
        opts.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, say
        raise EngineSetupError(f"--out {opts.out}: cannot make the directory: {e.strerror}") from None
    return run(opts)


def cmd_profile(args) -> int:
    from engine_templates.engine.bench.profile import run

    return run(args)


def cmd_random_checkpoint(args) -> int:
    from engine_templates.engine.random_checkpoint import human_size, write_random_checkpoint

    r = write_random_checkpoint(args.preset, args.out, seed=args.seed, device=args.device,
                                layers=args.layers, force=args.force)
    print(f"{r['preset']}: {r['parameters']:,} parameters, {human_size(r['bytes'])} in {r['shards']} "
          f"shard(s), {r['seconds']:.1f} s -> {r['path']}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"infersmith: {message} (see `{self.prog} --help`)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m engine_templates.engine")
    add_commands(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    args = parser.parse_args(argv)
    from engine_templates.engine.config import EngineSetupError

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        return args.engine_fn(args)
    except EngineSetupError as e:
        print(f"infersmith: {e}", file=sys.stderr)
        return 2
