"""The accuracy prompts again, under load: while AIPerf loads a server with one traffic pattern, a
few of the accuracy prompts (a held-out one among them) go to the URL AIPerf loads, so that an
engine that is right alone but wrong when it batches requests together is caught. They are sent
once AIPerf's measured phase has begun (its log says so), a moment later, all at once; afterwards
AIPerf's own record of every measured request says whether each of them really overlapped one.
One of them is fresh: a held-out prompt drawn for that pattern alone, which the server has never
been asked before, so that a server that keeps its answers and gives them again cannot pass on
answers it gave alone.

Why not judge AIPerf's own requests: the reference answers before the candidate starts, alone on
its GPU, and AIPerf draws its prompts only while it loads the candidate, so the reference has no
answers for them; answering them afterwards would mean a second reference session per pattern."""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from contract.serve import Completion, Pattern, PatternRun
from harness.serve import aiperf
from harness.serve.accuracy import complete

LOAD_STARTED = b"(profiling) started"  # AIPerf 0.13's log line as its measured phase begins
# After that line (it comes within milliseconds of the first measured request), so that the
# measured requests are in flight, past their first step, when these arrive.
SETTLE_S = 0.1
POLL_S = 0.02
READ_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError)  # a reply that is not what was asked


def sample(prompts: int, held_out: int, k: int, pattern: str, fresh: int | None = None) -> list[int]:
    """The numbers of the k prompts sent under `pattern`'s load: with `fresh` (the number of a
    prompt drawn for this pattern alone), it and k - 1 of the first `prompts`, those answered
    before load; without, k of those, a held-out one (of the last `held_out`) among them when
    there is one. The same wherever it is drawn: a pool host's controller judges what the host
    sent without taking its word for which."""
    rng = random.Random(pattern)
    if fresh is not None:
        k = min(k, prompts + 1)
        return sorted(rng.sample(range(prompts), k - 1)) + [fresh] if k else []
    k = min(k, prompts)
    if k == 0:
        return []
    first = [rng.randrange(prompts - held_out, prompts)] if held_out else []
    rest = [n for n in range(prompts) if n not in first]
    return sorted(first + rng.sample(rest, k - len(first)))


@dataclass
class Probes:
    """The prompts sent under load: their numbers, the completions (None where one failed, and
    why), and when each was in flight (wall-clock ns, AIPerf's clock)."""

    numbers: list[int]
    completions: list[Completion] | None = None
    error: str = ""
    spans: list[tuple[int, int]] = field(default_factory=list)
    overlapped: int = 0  # how many overlapped at least one of AIPerf's measured requests in time
    alongside: int = 0  # the most measured requests one of them overlapped

    def metrics(self, pattern: str) -> dict[str, float]:
        return {f"{pattern}/under_load_prompts": len(self.numbers), f"{pattern}/under_load_overlapped": self.overlapped,
                f"{pattern}/under_load_alongside": self.alongside}


def load(p: Pattern, url: str, model: str, tokenizer_dir: Path, out_dir: Path, timeout_s: float,
         prompts: list[list[int]], numbers: list[int], max_tokens: int) -> tuple[PatternRun, Probes | None]:
    """aiperf.run() for the pattern, and meanwhile prompts[n] for every n of numbers, greedy, to
    the same URL. Without numbers, the load alone. AIPerf's failure is raised after the prompts
    are back."""
    if not numbers:
        return aiperf.run(p, url, model, tokenizer_dir, out_dir, timeout_s), None
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(aiperf.run, p, url, model, tokenizer_dir, out_dir, timeout_s)
        probes = _send(loading, url, model, out_dir / "aiperf.log", [prompts[n] for n in numbers], numbers,
                       max_tokens, deadline)
        run = loading.result()
    probes.overlapped, probes.alongside = overlap(probes.spans, out_dir / "profile_export.jsonl")
    return run, probes


def _send(loading: Future, url: str, model: str, log: Path, prompts: list[list[int]], numbers: list[int],
          max_tokens: int, deadline: float) -> Probes:
    """Once the measured phase has begun (or AIPerf has ended: then they are judged all the same,
    and overlapped says they came late), every prompt at once."""
    while not loading.done() and not _started(log):
        time.sleep(POLL_S)
    if loading.done() and loading.exception() is not None:  # no load to send them under: its error says why
        return Probes(numbers, error="AIPerf did not run")
    if not loading.done():
        time.sleep(SETTLE_S)

    def one(prompt: list[int]) -> tuple[Completion, tuple[int, int]]:
        t0 = time.time_ns()
        got = complete(url, model, prompt, max_tokens, 0, max(deadline - time.monotonic(), 1.0))
        return got, (t0, time.time_ns())

    probes = Probes(numbers)
    with ThreadPoolExecutor(len(prompts)) as pool:
        pending = [pool.submit(one, prompt) for prompt in prompts]
        done = []
        for f in pending:
            try:
                done.append(f.result())
            except READ_ERRORS as e:
                probes.error = probes.error or f"no usable greedy completion with logprobs: {type(e).__name__}: {e}"
    if not probes.error:
        probes.completions = [c for c, _ in done]
    probes.spans = [span for _, span in done]
    return probes


def _started(log: Path) -> bool:
    try:
        return LOAD_STARTED in log.read_bytes()
    except OSError:  # AIPerf has not opened it yet
        return False


def overlap(spans: list[tuple[int, int]], records: Path) -> tuple[int, int]:
    """(how many spans overlapped at least one measured request in AIPerf's per-request records,
    the most measured requests one span overlapped); none when the records cannot be read."""
    try:
        lines = records.read_text().splitlines()
    except OSError:
        return 0, 0
    measured = []
    for line in lines:
        try:
            meta = json.loads(line)["metadata"]
            if meta.get("benchmark_phase") == "profiling":
                measured.append((int(meta["request_start_ns"]), int(meta["request_end_ns"])))
        except (ValueError, KeyError, TypeError):
            continue
    counts = [sum(s0 < e1 and e0 < s1 for e0, e1 in measured) for s0, s1 in spans]
    return sum(c > 0 for c in counts), max(counts, default=0)


def renamed(pattern: str, judged: dict[str, float]) -> dict[str, float]:
    """The judgement's `accuracy/<name>` metrics as `<pattern>/under_load_<name>`."""
    return {f"{pattern}/under_load_{k.split('/', 1)[1]}": v for k, v in judged.items()}


def prefix(pattern: str) -> str:
    return f"under load on pattern {pattern}: "


def detail(pattern: str, judged: str, metrics: dict[str, float]) -> str:
    """The under-load gate's detail: the pattern, the judgement, whether they overlapped the load."""
    n = int(metrics.get(f"{pattern}/under_load_prompts", 0))
    over = int(metrics.get(f"{pattern}/under_load_overlapped", 0))
    most = int(metrics.get(f"{pattern}/under_load_alongside", 0))
    return f"{prefix(pattern)}{judged}; {over} of {n} overlapped AIPerf's measured requests (one as many as {most})"
