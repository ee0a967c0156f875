"""`engine generate`, `engine serve`, `engine serve-reference`, `engine bench`, `engine profile`,
`engine random-checkpoint` and `engine quantize`: shared by `infersmith engine ...` and, on a GPU host
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

from engine_templates.engine.bench_cli import add_bench_commands


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def add_commands(sub) -> None:
    """Adds `generate`, `serve`, `serve-reference`, `bench`, `profile`, `random-checkpoint` and `quantize` to an argparse
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
    add_bench_commands(sub)
    c = sub.add_parser("random-checkpoint", help="write an HF-format model directory with random bf16 "
                                                 "weights at a preset's or a config's shape and a tokenizer for them")
    which = c.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", help="the model preset whose shape it has, e.g. qwen3-8b, llama-3.1-8b, or "
                                        "sam3 (a vision model: transformers' Sam3Model as it initialises itself)")
    which.add_argument("--config", help="a model's config.json (or its directory) whose architecture and shape "
                                        "it has (a SAM 3 one too)")
    c.add_argument("--out", required=True, type=Path, help="the model directory to write")
    c.add_argument("--seed", type=int, default=0, help="the weights' seed (`engine bench --seed` draws the same)")
    c.add_argument("--device", help="where the weights are drawn: cuda or cpu (default: cuda when available)")
    c.add_argument("--layers", type=int, help="this many layers instead of the preset's (a small "
                                              "checkpoint of the real width)")
    c.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing its "
                                                        "config, tokenizer and safetensors files")
    c.set_defaults(engine_fn=cmd_random_checkpoint)
    q = sub.add_parser("quantize", help="write an FP8 (e4m3) copy of a bf16 checkpoint, in the layout of "
                                        "Qwen's FP8 releases (block scales `weight_scale_inv`)")
    q.add_argument("src", type=Path, help="the bf16 model directory")
    q.add_argument("dst", type=Path, help="the FP8 model directory to write")
    q.add_argument("--block", type=int, default=128, help="scale blocks of BLOCK x BLOCK weights (default 128, "
                                                          "as Qwen's); 0: one scale per output channel")
    q.add_argument("--device", help="where the weights are quantized: cuda or cpu (default: cuda when available)")
    q.add_argument("--force", action="store_true", help="write into a non-empty DST, replacing its checkpoint")
    q.set_defaults(engine_fn=cmd_quantize)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, type=Path, help="HF-format directory: config.json, "
                   "*.safetensors, tokenizer.json (an FP8 checkpoint is served in FP8)")
    p.add_argument("--quantization", choices=["fp8"], help="fp8: quantize a bf16 checkpoint's linear layers and "
                   "experts to FP8 (e4m3, one scale per output channel) at load")
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
    p.add_argument("--spec-tokens", type=int, default=0, help="speculative decoding by prompt lookup: draft "
                   "tokens verified per decode step (default 0: off); greedy requests only")
    p.add_argument("--spec-ngram", type=int, default=3, help="the longest n-gram of a sequence's last tokens "
                   "looked up in its earlier ones to draft (default 3; shorter ones are tried next)")
    p.add_argument("--moe-prefill", choices=["torch", "triton"], default="torch",
                   help="MoE calls of more than 64 tokens: torch (default: the kernels file's path, torch's grouped "
                        "GEMMs where they run) or triton (Triton grouped GEMMs, tried at start; torch where refused)")
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
                        num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager, seed=args.seed,
                        quantization=args.quantization or "", spec_tokens=args.spec_tokens,
                        spec_ngram=args.spec_ngram, moe_prefill=args.moe_prefill)


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


def cmd_random_checkpoint(args) -> int:
    from engine_templates.engine.random_checkpoint import human_size, write_random_checkpoint

    r = write_random_checkpoint(args.preset or args.config, args.out, seed=args.seed, device=args.device,
                                layers=args.layers, force=args.force)
    print(f"{r['model']}: {r['parameters']:,} parameters, {human_size(r['bytes'])} in {r['shards']} "
          f"shard(s), {r['seconds']:.1f} s -> {r['path']}")
    return 0


def cmd_quantize(args) -> int:
    from engine_templates.engine.quantize import quantize_checkpoint
    from engine_templates.engine.random_checkpoint import human_size

    r = quantize_checkpoint(args.src, args.dst, block=args.block, device=args.device, force=args.force)
    print(f"{r['matrices']} matrices to FP8: {human_size(r['bytes_before'])} -> {human_size(r['bytes_after'])} "
          f"in {r['seconds']:.1f} s -> {r['path']}")
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
