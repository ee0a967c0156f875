"""The timed phases, for the engine and for HF transformers `generate`, and the agreement check.

Every time is wall-clock between two device synchronisations. Prompts are random token ids
(no tokenizer); nothing stops at an EOS. A phase that would run longer than `cap_s` stops
there and reports the tokens it made in the time it took (`capped` in the result).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine_templates.engine.config import EngineSetupError, at_least
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.sequence import SamplingParams


@dataclass(frozen=True)
class Workload:
    decode_prompt: int = 32
    decode_tokens: int = 128
    hf_decode_tokens: int = 32
    ttft_lengths: tuple[int, ...] = (512, 2048)
    ttft_reps: int = 3
    concurrency: int = 32
    concurrent_prompt: int = 128
    concurrent_tokens: int = 128
    hf_concurrent_tokens: int = 32
    check_prompts: int = 3
    check_prompt_len: int = 16
    check_tokens: int = 8
    cap_s: float = 20.0
    decode_contexts: tuple[int, ...] = ()  # batch-1 decode after prompts this long (the engine only)

    def __post_init__(self):
        # The options of `engine bench` (engine_templates/engine/cli.py) named as it names them.
        for name in ("decode_tokens", "hf_decode_tokens", "ttft_reps", "concurrency", "concurrent_prompt",
                     "concurrent_tokens", "hf_concurrent_tokens", "check_tokens"):
            at_least(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        for name in ("decode_prompt", "check_prompts", "check_prompt_len"):
            at_least(name, getattr(self, name), 1)
        if not self.ttft_lengths or min(self.ttft_lengths) < 1:
            raise EngineSetupError(f"--ttft-lengths must be at least 1, not {list(self.ttft_lengths)}")
        if self.decode_contexts and min(self.decode_contexts) < 1:
            raise EngineSetupError(f"--decode-contexts must be at least 1, not {list(self.decode_contexts)}")
        if self.cap_s <= 0:
            raise EngineSetupError(f"--phase-seconds must be more than 0, not {self.cap_s}")

    def max_len(self) -> int:
        """The longest sequence any phase makes."""
        return max(max(self.ttft_lengths) + 1, max((self.decode_prompt, *self.decode_contexts)) + self.decode_tokens + 1,
                   self.concurrent_prompt + self.concurrent_tokens,
                   self.check_prompt_len + self.check_tokens)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (count, length), generator=gen).tolist()


# --- the engine -----------------------------------------------------------------------------

def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, ignore_eos=True)


def engine_decode(engine: LLMEngine, prompt: list[int], tokens: int, cap_s: float) -> dict:
    """Batch-1 decode rate: the tokens after the first, over the time after the first."""
    device = engine.config.device
    seq = engine.add_request(prompt, _greedy(tokens + 1))
    while seq.num_completion_tokens == 0:
        engine.step()
    sync(device)
    start = time.perf_counter()
    while not seq.is_finished and time.perf_counter() - start < cap_s:
        engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    engine.abort(seq)
    n = seq.num_completion_tokens - 1
    return {"tokens": n, "seconds": seconds, "value": n / seconds, "capped": n < tokens}


def engine_ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from submitting one prompt to its first token."""
    device = engine.config.device
    sync(device)
    start = time.perf_counter()
    seq = engine.add_request(prompt, _greedy(1))
    while not seq.is_finished:
        engine.step()
    sync(device)
    return time.perf_counter() - start


def engine_concurrent(engine: LLMEngine, prompts: list[list[int]], tokens: int, cap_s: float) -> dict:
    """All prompts submitted at once; output tokens over the time until the last finished
    (prefill included), and the decode-only rate after every sequence had its first token."""
    device = engine.config.device
    sync(device)
    start = time.perf_counter()
    seqs = [engine.add_request(p, _greedy(tokens)) for p in prompts]
    decode_start, decode_tokens = None, 0
    while engine.has_unfinished() and time.perf_counter() - start < cap_s:
        engine.step()
        if decode_start is None and all(s.num_completion_tokens for s in seqs):
            sync(device)
            decode_start, decode_tokens = time.perf_counter(), sum(s.num_completion_tokens for s in seqs)
    sync(device)
    end = time.perf_counter()
    for seq in seqs:
        engine.abort(seq)
    total = sum(s.num_completion_tokens for s in seqs)
    decode_rate = ((total - decode_tokens) / (end - decode_start)
                   if decode_start is not None and end > decode_start else None)
    return {"tokens": total, "seconds": end - start, "value": total / (end - start),
            "decode_only_tok_s": decode_rate, "capped": total < tokens * len(prompts)}


def engine_phases(engine: LLMEngine, work: Workload, vocab: int, seed: int, log) -> dict:
    metrics = {}
    prompt = random_prompts(1, work.decode_prompt, vocab, seed + 1)[0]
    engine_decode(engine, prompt, 4, work.cap_s)  # warm-up
    metrics["decode_b1_tok_s"] = engine_decode(engine, prompt, work.decode_tokens, work.cap_s)
    log(f"  decode b=1: {metrics['decode_b1_tok_s']['value']:.1f} tok/s")
    for n in work.decode_contexts:
        key = f"decode_b1_ctx{n}_tok_s"
        metrics[key] = engine_decode(engine, random_prompts(1, n, vocab, seed + 4)[0], work.decode_tokens, work.cap_s)
        log(f"  decode b=1 after {n} tokens: {metrics[key]['value']:.1f} tok/s")
    for n in work.ttft_lengths:
        prompts = random_prompts(work.ttft_reps + 1, n, vocab, seed + n)
        times = [engine_ttft(engine, p) for p in prompts][1:]  # the first is the warm-up
        metrics[f"ttft_{n}_ms"] = {"value": 1e3 * statistics.median(times), "runs_ms": [1e3 * t for t in times]}
        log(f"  TTFT {n}: {metrics[f'ttft_{n}_ms']['value']:.1f} ms")
    prompts = random_prompts(work.concurrency, work.concurrent_prompt, vocab, seed + 2)
    engine_concurrent(engine, prompts, 2, work.cap_s)  # warm-up
    key = f"concurrent_{work.concurrency}_tok_s"
    metrics[key] = engine_concurrent(engine, prompts, work.concurrent_tokens, work.cap_s)
    log(f"  {work.concurrency} concurrent: {metrics[key]['value']:.1f} tok/s")
    return metrics


# --- HF transformers generate ---------------------------------------------------------------

def _hf_generate(model, prompts: list[list[int]], new_tokens: int, cap_s: float | None = None,
                 streamer=None):
    """(new tokens per sequence, seconds) of one greedy generate() over an unpadded batch."""
    ids = torch.tensor(prompts, device=model.device)
    sync(str(model.device))
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, max_time=cap_s, pad_token_id=0,
                         temperature=None, top_p=None, top_k=None, streamer=streamer)
    sync(str(model.device))
    return out.shape[1] - ids.shape[1], time.perf_counter() - start


def _token_clock(device: str):
    """A generate() streamer that notes when each token is ready: the prompt first, then one
    call per new token (generate() waits for each token anyway, so the sync costs nothing)."""
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            sync(device)
            self.times.append(time.perf_counter())

        def end(self):
            pass

    return TokenClock()


def hf_phases(model, work: Workload, vocab: int, seed: int, log) -> dict:
    metrics = {}
    prompt = random_prompts(1, work.decode_prompt, vocab, seed + 1)
    _hf_generate(model, prompt, 2)  # warm-up
    clock = _token_clock(str(model.device))
    _hf_generate(model, prompt, work.hf_decode_tokens + 1, work.cap_s, clock)
    n, seconds = len(clock.times) - 2, clock.times[-1] - clock.times[1]  # after the first new token
    metrics["decode_b1_tok_s"] = {"tokens": n, "seconds": seconds, "value": n / seconds,
                                  "capped": n < work.hf_decode_tokens}
    log(f"  decode b=1: {metrics['decode_b1_tok_s']['value']:.1f} tok/s")
    for length in work.ttft_lengths:
        prompts = random_prompts(work.ttft_reps + 1, length, vocab, seed + length)
        times = [_hf_generate(model, [p], 1)[1] for p in prompts][1:]
        metrics[f"ttft_{length}_ms"] = {"value": 1e3 * statistics.median(times),
                                        "runs_ms": [1e3 * t for t in times]}
        log(f"  TTFT {length}: {metrics[f'ttft_{length}_ms']['value']:.1f} ms")
    prompts = random_prompts(work.concurrency, work.concurrent_prompt, vocab, seed + 2)
    _hf_generate(model, prompts, 2)  # warm-up
    n, seconds = _hf_generate(model, prompts, work.hf_concurrent_tokens, work.cap_s)
    key = f"concurrent_{work.concurrency}_tok_s"
    metrics[key] = {"tokens": n * len(prompts), "seconds": seconds, "value": n * len(prompts) / seconds,
                    "capped": n < work.hf_concurrent_tokens}
    log(f"  {work.concurrency} concurrent (one batch): {metrics[key]['value']:.1f} tok/s")
    return metrics


# --- agreement ------------------------------------------------------------------------------

def vs_hf(oracle, prompts: list[list[int]], seqs, hf_greedy: list[list[int]], tol: float) -> dict:
    """The engine's greedy tokens scored by HF in one teacher-forced pass per prompt: how far
    each is below HF's own best token (0: HF's argmax too), and how far the engine's
    log-probability of it is from HF's. HF's own greedy generate() tokens are compared too."""
    gap = diff = 0.0
    prefix = []
    for prompt, seq, hf_tokens in zip(prompts, seqs, hf_greedy):
        rows = oracle.logprob_rows(prompt, seq.completion_token_ids)
        chosen = rows[torch.arange(len(rows)), seq.completion_token_ids]
        gap = max(gap, float((rows.max(dim=1).values - chosen).max()))
        diff = max(diff, float((chosen - torch.tensor(seq.logprobs, dtype=torch.float64)).abs().max()))
        prefix.append(next((i for i, (a, b) in enumerate(zip(hf_tokens, seq.completion_token_ids))
                            if a != b), len(hf_tokens)))
    return {"agree": gap <= tol and diff <= tol, "worst_gap_to_hf_argmax": gap,
            "max_logprob_diff": diff, "hf_greedy_equal_prefix": prefix, "tolerance": tol}


def graphs_vs_eager(graph_seqs, eager_seqs) -> dict:
    equal = [g.completion_token_ids == e.completion_token_ids for g, e in zip(graph_seqs, eager_seqs)]
    diff = 0.0
    for g, e in zip(graph_seqs, eager_seqs):
        same = next((i for i, (a, b) in enumerate(zip(g.completion_token_ids, e.completion_token_ids))
                     if a != b), len(g.completion_token_ids))
        diff = max([diff] + [abs(a - b) for a, b in zip(g.logprobs[:same], e.logprobs[:same])])
    return {"tokens_equal": all(equal), "max_logprob_diff_common_prefix": diff}


def check(engine: LLMEngine, eager: LLMEngine, oracle, work: Workload, vocab: int, seed: int,
          tol: float) -> dict:
    """Greedy tokens of the engine (CUDA graphs where it has them), of the same engine with
    --enforce-eager, and HF's view of both. The graphs agree with eager when their tokens are
    equal or when both are HF's greedy choices within the tolerance (a near-tie can flip)."""
    prompts = random_prompts(work.check_prompts, work.check_prompt_len, vocab, seed + 3)
    params = _greedy(work.check_tokens)
    graph_seqs = engine.generate(prompts, params)
    eager_seqs = eager.generate(prompts, params)
    out = {"graphs": engine.runner.graphs is not None,
           "graphs_vs_eager": graphs_vs_eager(graph_seqs, eager_seqs)}
    if oracle is not None:
        hf_greedy = [oracle.greedy(p, work.check_tokens) for p in prompts]
        out["engine_vs_hf"] = vs_hf(oracle, prompts, graph_seqs, hf_greedy, tol)
        out["eager_vs_hf"] = vs_hf(oracle, prompts, eager_seqs, hf_greedy, tol)
    ge = out["graphs_vs_eager"]
    ge["agree"] = ge["tokens_equal"] or (oracle is not None and out["engine_vs_hf"]["agree"]
                                         and out["eager_vs_hf"]["agree"])
    out["agree"] = ge["agree"] and (oracle is None or out["engine_vs_hf"]["agree"])
    return out
