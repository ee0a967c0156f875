"""`engine bench --serving FILE`: each traffic pattern of a serving file, run in process on the
engine, so that what `serve-bench` measures through the server can be read against what the engine
itself does on the same workload.

Per pattern, as AIPerf drives the server (harness/serve/aiperf.py): `warmup_requests` requests
first, untimed; then `request_count` requests (or as many as `duration_s` allows), at most
`concurrency` in flight — a new one submitted as soon as one finishes — or, with `request_rate`,
submitted at that rate (evenly spaced). Each request's prompt is random token ids, its length
drawn from the pattern's mean and standard deviation; it generates exactly its output length
(EOS ignored). A structured or file dataset's text is not used: the token ids are random either
way, which matters only to speculative decoding. The figures carry the serve stage's metric names
(contract.serve.METRICS), measured between the engine's steps with the host's clock after a device
synchronisation: time to first token from submission, inter-token latency and per-user output
rate after the first token, and output tokens/s over the pattern's measured span.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path

from contract.serve import Pattern
from engine_templates.engine.config import EngineSetupError
from engine_templates.engine.sequence import SamplingParams


def load_patterns(path: Path) -> tuple[Pattern, ...]:
    """The traffic patterns of a serving file (YAML, `traffic:` as the target's serving file)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise EngineSetupError(f"--serving {path}: cannot read it: {e}") from None
    traffic = data.get("traffic") if isinstance(data, dict) else None
    if not traffic or not isinstance(traffic, list):
        raise EngineSetupError(f"--serving {path}: no `traffic:` list of patterns")
    known = {f.name for f in fields(Pattern)}
    patterns = []
    for i, entry in enumerate(traffic):
        if not isinstance(entry, dict) or "name" not in entry:
            raise EngineSetupError(f"--serving {path}: pattern {i + 1} is not a mapping with a name")
        unknown = sorted(set(entry) - known)
        if unknown:
            raise EngineSetupError(f"--serving {path}: pattern {entry['name']!r}: unknown fields {unknown}; "
                                   f"known: {', '.join(sorted(known))}")
        p = Pattern(**entry)
        if (p.concurrency is None) == (p.request_rate is None):
            raise EngineSetupError(f"--serving {path}: pattern {p.name!r}: give concurrency or request_rate, one")
        if p.request_count is None and p.duration_s is None:
            raise EngineSetupError(f"--serving {path}: pattern {p.name!r}: give request_count or duration_s")
        patterns.append(p)
    return tuple(patterns)


def longest(p: Pattern) -> int:
    """The longest sequence a pattern makes (prompt three deviations over its mean)."""
    return p.input_tokens_mean + 3 * p.input_tokens_stddev + p.output_tokens_mean + 3 * p.output_tokens_stddev


def in_flight(p: Pattern) -> int:
    """How many requests a pattern keeps in flight at most (a rate's: as many as the engine takes)."""
    return p.concurrency or 64


@dataclass
class _Request:
    submitted: float
    seq: object
    first: float | None = None
    done: float | None = None


def _length(rng: random.Random, mean: int, stddev: int) -> int:
    return max(1, round(rng.gauss(mean, stddev))) if stddev else mean


def _run(engine, p: Pattern, count: int | None, rng: random.Random, vocab: int, sync, until: float | None) -> list:
    """Submits and serves one batch of requests of the pattern; the requests with their times."""
    pending = count if count is not None else 1 << 30
    gap = 1.0 / p.request_rate if p.request_rate else 0.0
    live, done = [], []
    next_at = time.perf_counter()
    while pending or live:
        now = time.perf_counter()
        while pending and (until is None or now < until) and (
                (p.concurrency and len(live) < p.concurrency) or (gap and now >= next_at)):
            ids = [rng.randrange(vocab) for _ in range(_length(rng, p.input_tokens_mean, p.input_tokens_stddev))]
            out = _length(rng, p.output_tokens_mean, p.output_tokens_stddev)
            live.append(_Request(now, engine.add_request(ids, SamplingParams(max_tokens=out, ignore_eos=True))))
            pending, next_at = pending - 1, next_at + gap
        if until is not None and now >= until:
            pending = 0
        if not live:  # a rate's next request is not due yet
            time.sleep(max(0.0, min(next_at - now, 0.01)))
            continue
        engine.step()
        sync()
        now = time.perf_counter()
        for r in live:
            if r.first is None and r.seq.num_completion_tokens:
                r.first = now
            if r.seq.is_finished:
                r.done = now
        done += [r for r in live if r.done is not None]
        live = [r for r in live if r.done is None]
    return done


def _pct(values: list[float], q: int) -> float:
    """The q-th percentile (1 <= q <= 99), interpolated as AIPerf's are."""
    return values[0] if len(values) == 1 else statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def measure_pattern(engine, p: Pattern, vocab: int, seed: int, sync) -> dict:
    """The pattern's figures under the serve stage's metric names (module docstring)."""
    rng = random.Random(f"{seed}/{p.name}")
    if p.warmup_requests:
        _run(engine, p, p.warmup_requests, rng, vocab, sync, None)
    start = time.perf_counter()
    until = start + p.duration_s if p.duration_s else None
    done = _run(engine, p, p.request_count, rng, vocab, sync, until)
    span = max(r.done for r in done) - start
    ttft = [1e3 * (r.first - r.submitted) for r in done]
    after = [(r.done - r.first, r.seq.num_completion_tokens - 1) for r in done if r.seq.num_completion_tokens > 1]
    itl = [1e3 * t / n for t, n in after]
    per_user = [n / t for t, n in after if t > 0]
    out = {"requests": len(done), "output_tokens": sum(r.seq.num_completion_tokens for r in done),
           "span_s": span, "ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90)}
    out["output_tps"] = out["output_tokens"] / span
    if itl:
        out |= {"itl_p50_ms": _pct(itl, 50), "itl_p90_ms": _pct(itl, 90)}
    if per_user:
        out |= {"output_tps_per_user_p50": _pct(per_user, 50), "output_tps_per_user_p10": _pct(per_user, 10)}
    return out
