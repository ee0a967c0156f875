"""Where the engine's time to first token goes between `engine bench` and `engine serve`.

`engine bench` measured 21.9 ms at 512 prompt tokens on qwen3-8b (in-process, a prompt right
after another); `engine serve` answered the same length in 37-75 ms with the request taken by
the engine thread within 1.5 ms (docs/BENCHMARKS.md). This probe
times one 512-token prompt's first token in-process, on random weights of a preset, changing
one thing at a time between the two:

  bench config      the engine as `engine bench` builds it (model length just past the prompt,
                    KV blocks for it, one CUDA-graph batch size), prompts back to back
  server config     the engine as `engine serve` builds it (EngineConfig's defaults: model
                    length MAXLEN, KV cache from gpu_memory_utilization, graphs for 1..64)
  + idle gap        the same, each prompt after IDLE seconds of an idle GPU (a client's think time)
  + engine thread   the same, prompts submitted through EngineLoop's thread, as the server does
  + keep-warm       the idle gap spent with the GPU kept busy by a small kernel loop

Usage (a GPU host, repo root): python3 bench/ttft_probe.py [--preset qwen3-8b] [--kernels FILE]
    [--tokens 512] [--reps 5] [--idle 0.5] [--max-model-len 40960]
Prints one line per variant: the median and every rep in ms.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from engine_templates.engine.config import EngineConfig, EngineSetupError, ModelConfig
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.engine_loop import EngineLoop, Request
from engine_templates.engine.kernels import parse_kernels_file
from engine_templates.engine.loader import random_weights
from engine_templates.engine.sequence import SamplingParams
from engine_templates.models import PRESETS


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU only to check the script itself


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def in_process(engine: LLMEngine, batch: list[list[int]], idle: float, keep_warm: bool) -> list[float]:
    times = []
    for prompt in batch:
        if idle:
            end = time.perf_counter() + idle
            a = torch.randn(1024, 1024, device=DEVICE)
            while time.perf_counter() < end:
                if keep_warm:
                    a = a.mul_(0.5).add_(1.0)
                    sync()
                else:
                    time.sleep(0.01)
        sync()
        start = time.perf_counter()
        seq = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while not seq.is_finished:
            engine.step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def through_thread(engine: LLMEngine, batch: list[list[int]], idle: float) -> list[float]:
    """As the server: an asyncio loop submits to EngineLoop and awaits the first update."""
    loop_obj = EngineLoop(engine)
    loop_obj.start()
    times = []

    async def one(prompt):
        request = Request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), asyncio.get_running_loop())
        start = time.perf_counter()
        loop_obj.submit(request)
        while True:
            update = await request.updates.get()
            if update.error:
                raise RuntimeError(update.error)
            if update.finish_reason:
                times.append(request.first_token - start)
                return

    async def main():
        for prompt in batch:
            await asyncio.sleep(idle)
            await one(prompt)

    asyncio.run(main())
    loop_obj.stop()
    return times


def report(name: str, times: list[float]) -> None:
    ms = [1e3 * t for t in times]
    print(f"{name:<34} median {statistics.median(ms):7.1f} ms   runs {', '.join(f'{t:.1f}' for t in ms)}",
          flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--kernels", type=Path, default=Path("engine_templates/engine/bench/templates.json"))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--idle", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=40960)
    args = p.parse_args()
    if args.tokens < 1 or args.reps < 1 or args.idle < 0 or args.max_model_len <= args.tokens + 8:
        p.error("--tokens and --reps at least 1, --idle not negative, --max-model-len above --tokens + 8")
    cfg = ModelConfig.from_preset(PRESETS[args.preset])
    try:
        kernels = parse_kernels_file(args.kernels)
    except EngineSetupError as e:
        p.error(str(e))
    weights = random_weights(cfg, torch.bfloat16, DEVICE)
    print(f"{args.preset} on {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, kernels {args.kernels}, {args.tokens} prompt tokens",
          flush=True)

    length = args.tokens + 8
    bench = LLMEngine(EngineConfig(model_dir=None, device=DEVICE, max_num_seqs=1, max_model_len=length,
                                   num_kv_blocks=-(-length // 16) + 1, kernels=kernels,
                                   cuda_graph_batch_sizes=(1,)), cfg, weights)
    batch = prompts(args.reps + 1, args.tokens, cfg.vocab, 1)
    report("bench config", in_process(bench, batch, 0, False)[1:])
    del bench
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

    t = time.perf_counter()
    server = LLMEngine(EngineConfig(model_dir=None, device=DEVICE, max_model_len=args.max_model_len,
                                    kernels=kernels), cfg, weights)
    print(f"(server-config engine built in {time.perf_counter() - t:.1f} s, {server.runner.num_blocks} KV blocks)",
          flush=True)
    report("server config", in_process(server, batch, 0, False)[1:])
    report(f"server config + idle {args.idle} s", in_process(server, batch, args.idle, False))
    report("server config + idle, keep-warm", in_process(server, batch, args.idle, True))
    report("server config + idle + engine thread", through_thread(server, batch, args.idle))
    report("server config + engine thread, no idle", through_thread(server, batch, 0.0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
