"""`engine bench --profile`: where one prefill step's time goes at each TTFT length, and one
batch-1 decode step's, per category of op, on the engine the bench times.

Each step is timed without the profiler (its wall time, between two device synchronisations,
after a warm-up of the same shape), then run again under torch.profiler; on a CPU the wall time
the categories are read against is the profiled run's (the profiler's cost is in the op times). On a GPU a category's
time is the summed duration of its kernels (the device's busy time); on a CPU, where the bench
runs in CI, the summed self time of torch's ops (host times: they say nothing of a GPU). Launch
gaps are the step's wall time less the kernels' sum: the host's share the device does not hide
(launches, Python, scheduling, sampling, the token's copy back).

A kernel's category comes from the engine op it runs in — each op of the KernelSet and the MoE
block (`DecoderModel._moe`: router, routing, expert GEMMs, whichever path) wrapped in a
`record_function` range for the profiled step only — and, outside every op (the linear layers,
the embedding, the KV-cache writes, the sampler) or inside a CUDA graph replay (a decode step
with graphs), from its name (RULES). Inside the MoE block a GEMM (torch's, the grouped GEMMs,
the fused kernels' gate/up and down passes) is `moe_gemm` and the rest (routing, sorting, the
gathers, the activation, the slot sum) `moe_routing`.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.kernels import ENGINE_OPS
from engine_templates.engine.sequence import SamplingParams

CATEGORIES = ("gemm", "attention", "norm", "rope", "moe_gemm", "moe_routing", "elementwise", "other")
RANGE = "engine_op::"
OP_CATEGORY = {"rmsnorm": "norm", "fused_add_rmsnorm": "norm", "qk_norm_rope": "rope", "rope": "rope",
               "prefill_attention": "attention", "decode_attention": "attention", "silu_mul": "elementwise",
               "fused_moe": "moe"}
# By name, first match wins (kernels of CUDA or Triton, or torch's CPU ops). The engine's Triton
# kernels by their function names (engine_templates/ops/*/templates.py), then torch's and cuBLAS's.
RULES = (
    ("moe_gemm", r"^_(gate_up_act|down|gate_up_grouped|down_grouped)\b|grouped_mm"),
    ("moe_routing", r"^_(route|sum_slots)\b"),
    ("rope", r"rope|rotary|_rotate_heads"),
    ("attention", r"attention|attn|flash|fmha|split_kv|sdpa"),
    ("norm", r"norm"),
    ("gemm", r"gemm|gemv|cublas|cutlass|nvjet|xmma|splitk|^_linear\b|aten::(mm|addmm|bmm|matmul|linear|_scaled_mm)$"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|index|fill|embedding|_silu_mul|silu|aten::"),
)
_COMPILED = tuple((cat, re.compile(rx, re.IGNORECASE)) for cat, rx in RULES)


def by_name(name: str) -> str:
    for category, rx in _COMPILED:
        if rx.search(name):
            return category
    return "other"


def category(name: str, op: str | None) -> str:
    """A kernel's (or CPU op's) category: its engine op's where it runs in one, else its name's."""
    if op is None:
        return by_name(name)
    cat = OP_CATEGORY.get(op, "other")
    if cat != "moe":
        return cat
    return "moe_gemm" if by_name(name) in ("gemm", "moe_gemm") else "moe_routing"


def _ranged(name: str, fn):
    def call(*args, **kwargs):
        with torch.profiler.record_function(RANGE + name):
            return fn(*args, **kwargs)
    return call


@contextmanager
def ranges(engine: LLMEngine):
    """Each KernelSet op and the MoE block in a named range while the block runs; restored after."""
    kernels, model = engine.kernels, engine.runner.model
    saved = {op: getattr(kernels, op) for op in ENGINE_OPS if op != "fused_moe"}
    try:
        for op, fn in saved.items():
            setattr(kernels, op, _ranged(op, fn))
        model._moe = _ranged("fused_moe", model._moe)  # an instance attribute over the method
        yield
    finally:
        for op, fn in saved.items():
            setattr(kernels, op, fn)
        del model._moe


def _engine_op(event) -> str | None:
    """The innermost engine op range around a profiler event, None outside every one."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(RANGE):
            return parent.name[len(RANGE):]
        parent = parent.cpu_parent
    return None


def summarize(events, device_type: str, steps: int) -> dict:
    """Per step: {category: us}, the kernels' sum (`busy_us`) and the heaviest kernels by name."""
    per_cat: dict[str, float] = defaultdict(float)
    per_name: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])

    def add(name: str, cat: str, us: float) -> None:
        per_cat[cat] += us
        entry = per_name[(name, cat)]
        entry[0] += 1
        entry[1] += us

    if device_type == "cuda":
        linked: dict[str, float] = defaultdict(float)
        for e in events:  # kernels linked to the CPU event that launched them
            if e.device_type == torch.autograd.DeviceType.CPU and e.kernels:
                op = _engine_op(e)
                for k in e.kernels:
                    if k.name.startswith(RANGE):
                        continue
                    add(k.name, category(k.name, op), k.duration)
                    linked[k.name] += k.duration
        ran: dict[str, float] = defaultdict(float)
        for e in events:  # every kernel the device ran (not the ranges' spans on its timeline)
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0 and not e.name.startswith(RANGE):
                ran[e.name] += e.device_time
        for name, us in ran.items():  # what no launch was linked to (a graph replay's, say): by name
            if us - linked.get(name, 0.0) > 1e-3 * us:
                add(name, by_name(name), us - linked.get(name, 0.0))
        busy = sum(ran.values())
    else:
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith(RANGE) \
                    and e.name.startswith("aten::") and e.self_cpu_time_total > 0:
                add(e.name, category(e.name, _engine_op(e)), e.self_cpu_time_total)
        busy = sum(per_cat.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {"categories_us": {c: per_cat.get(c, 0.0) / steps for c in CATEGORIES},
            "busy_us": busy / steps,
            "top": [{"name": n[:120], "category": c, "calls": calls / steps, "us": us / steps}
                    for (n, c), (calls, us) in top]}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _profiled(engine: LLMEngine, run, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    device = engine.config.device
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with ranges(engine), profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        _sync(device)
        wall = (time.perf_counter() - start) / steps * 1e6
    return summarize(prof.events(), "cuda" if cuda else "cpu", steps) | {"profiled_wall_us": wall}


def _wall_us(engine: LLMEngine, run, steps: int) -> float:
    device = engine.config.device
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    return (time.perf_counter() - start) / steps * 1e6


def _finish(engine: LLMEngine, profile: dict, wall: float, **extra) -> dict:
    """`wall_us`, what the categories are read against: on a GPU the step without the profiler
    (which slows the host, not the kernels); on a CPU the profiled step itself, whose op times
    carry the profiler's cost too (`unprofiled_wall_us` beside it)."""
    device = torch.device(engine.config.device).type
    if device != "cuda":
        wall, profile = profile["profiled_wall_us"], profile | {"unprofiled_wall_us": wall}
    return {**extra, "wall_us": wall, "gap_us": wall - profile["busy_us"], **profile, "device": device}


def prefill_step(engine: LLMEngine, tokens: int, vocab: int, seed: int) -> dict:
    """The prefill of a prompt of `tokens` random tokens, to its first token: one step, or one per
    chunk where the prompt is longer than the step's token budget (`steps`; the figures are the
    whole prefill's). Warmed up once, timed once, profiled once, each on a fresh prompt."""
    gen = torch.Generator().manual_seed(seed)

    def run() -> None:
        prompt = torch.randint(vocab, (tokens,), generator=gen).tolist()
        seq = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while not seq.is_finished:
            engine.step()

    run()  # warm-up: kernels built and tuned at this shape
    wall = _wall_us(engine, run, 1)
    chunks = -(-tokens // engine.config.max_num_batched_tokens)
    return _finish(engine, _profiled(engine, run, 1), wall, tokens=tokens, steps=chunks)


def decode_step(engine: LLMEngine, prompt_tokens: int, vocab: int, seed: int, steps: int = 8) -> dict:
    """Batch-1 decode steps after a prompt of `prompt_tokens`, per step: `steps` timed and `steps`
    profiled, after as many of warm-up (with CUDA graphs where the engine has them: kernels
    named by their names only)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(vocab, (prompt_tokens,), generator=gen).tolist()
    steps = max(1, min(steps, (engine.config.max_model_len - prompt_tokens - 2) // 3))  # room in the model length
    seq = engine.add_request(prompt, SamplingParams(max_tokens=3 * steps + 2, ignore_eos=True))
    while seq.num_completion_tokens == 0:
        engine.step()

    def run() -> None:
        for _ in range(steps):
            engine.step()

    run()
    wall = _wall_us(engine, run, steps)
    out = _finish(engine, _profiled(engine, run, steps), wall, context=prompt_tokens, steps=steps,
                  graphs=engine.runner.graphs is not None)
    while not seq.is_finished:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return out


def profile_engine(engine: LLMEngine, ttft_lengths, decode_prompt: int, vocab: int, seed: int) -> dict:
    """{"prefill_<n>": ..., "decode_b1": ...}: one entry per step profiled."""
    out = {f"prefill_{n}": prefill_step(engine, n, vocab, seed) for n in ttft_lengths}
    out["decode_b1"] = decode_step(engine, decode_prompt, vocab, seed)
    return out


def _us(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def markdown(profiles: dict[str, dict]) -> list[str]:
    """One table per system: µs a step and share of the wall time per category, the kernels'
    sum, the launch gaps and the wall time, a column per step."""
    lines = []
    for system, prof in profiles.items():
        steps = list(prof)
        device = next(iter(prof.values()))["device"]
        unit = "device" if device == "cuda" else "CPU op self"
        lines += ["", f"Profile of {system} ({unit} time, µs a step; share of the step's wall time):", "",
                  "| category | " + " | ".join(steps) + " |", "|---|" + "---:|" * len(steps)]
        for cat in CATEGORIES:
            cells = [f"{_us(prof[s]['categories_us'][cat])} ({prof[s]['categories_us'][cat] / prof[s]['wall_us']:.0%})"
                     for s in steps]
            lines.append(f"| {cat} | " + " | ".join(cells) + " |")
        lines.append("| kernels (sum) | " + " | ".join(_us(prof[s]["busy_us"]) for s in steps) + " |")
        lines.append("| launch gaps (wall − kernels) | " + " | ".join(
            f"{_us(prof[s]['gap_us'])} ({prof[s]['gap_us'] / prof[s]['wall_us']:.0%})" for s in steps) + " |")
        lines.append("| step wall time | " + " | ".join(_us(prof[s]["wall_us"]) for s in steps) + " |")
    return lines
