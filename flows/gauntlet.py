"""`infersmith gauntlet`: both suites of gauntlet/ on one slot of a pool, as a table.

Each case runs through the same stages as any candidate (compile → check → bench, stopping
at the first that does not pass, in one session of a supervisor and a sandbox) on the same executor, so the table proves the gates of
the host it ran on. Red-team cases are cheap: most stop at screening or in the check stage.

With `jobs` > 1, that many cases run at once on the one slot, but never two bench stages (each
with its session's first stage, where the baselines are measured):
timing, the speed-of-light gate and the hidden-work cross-check see the GPU as a lone
candidate would; and each case may allocate only its share (1/jobs) of the device memory a
lone candidate may, so that one case's allocations never fail another's. A case marked
`alone` in the manifest (one that writes where every stage looks, such as the harness, or
takes memory until a limit stops it) runs after the others, with nothing beside it.
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

from contract.verdict import PASS, Verdict
from engine_templates.models import PRESETS
from engine_templates.ops import get_op
from gauntlet import Case
from gpu_pool.baselines import Baselines
from gpu_pool.executors import LocalExecutor, SSHExecutor, executor_for
from gpu_pool.pool import Slot
from targets import Target, is_tiny
from tasks.evaluate import jobs_for, run_stages
from tracking.ledger import Charge


@dataclass
class Row:
    case: Case
    verdict: Verdict
    seconds: float

    @property
    def got(self) -> str:
        v = self.verdict
        if v.status == PASS:
            return "pass" + (f" (flags: {', '.join(v.flags)})" if v.flags else "")
        return f"{v.status} {v.failing_gate.name if v.failing_gate else '?'}"

    @property
    def ok(self) -> bool:
        v, c = self.verdict, self.case
        if c.expect == "pass":
            return v.status == PASS and set(c.flags) <= set(v.flags)
        return (v.status == c.expect and v.failing_gate is not None and v.failing_gate.name == c.gate
                and c.detail in v.failing_gate.detail)


def target_for(case: Case, target: Target) -> Target:
    """The target a case runs on: the given one, with the case's stage time limit. An op whose
    shapes take the model's experts (fused_moe) gets, on a dense model, the mixture-of-experts
    preset of its size class, one whose shapes take a sliding window (the *_swa ops), on a model
    without one, the windowed preset, and a vision op (on a text model) the vision preset of its
    size class (and a text op on a vision model the text one): so that one `--model` runs every
    op's cases."""
    timeout = case.timeout_s or target.budget.stage_timeout_s
    update = {"budget": target.budget.model_copy(update={"stage_timeout_s": timeout})}
    if case.dtype:  # the op's target of that dtype, at its own default tolerance
        update |= {"dtype": case.dtype, "rtol": None, "approval_rtol": None}
    modality = get_op(case.op).modality
    moe, windowed = ("tiny-moe", "tiny-swa") if is_tiny(target.model) else ("qwen3-30b-a3b", "mistral-7b-v0.1")
    if modality != target.modality:  # a vision op's cases on the vision preset of the size class
        update["model"] = ("sam3-tiny" if is_tiny(target.model) else "sam3") if modality == "vision" else (
            "tiny" if is_tiny(target.model) else "qwen3-8b")
    elif modality == "text" and (not target.dims.is_moe or target.dims.sliding_window is None):
        dims = shape_dims(case.op, moe, windowed, target)
        if not target.dims.is_moe and "experts" in dims:
            update["model"] = moe
        elif target.dims.sliding_window is None and "window" in dims:
            update["model"] = windowed
    return target.model_copy(update=update)


def shape_dims(op: str, moe: str, windowed: str, target: Target) -> set[str]:
    """The dims of the op's shapes, asked of the op on a model that has every feature an op may
    take (the mixture-of-experts preset `moe` with the sliding window of the preset `windowed`).
    An error of the op's is raised, never taken for a reason to change the model."""
    w = target.workload
    every = replace(PRESETS[moe], sliding_window=PRESETS[windowed].sliding_window)
    return {k for s in get_op(op).shapes(every, w.decode_batches, w.prefill_tokens, w.contexts) for k in s.dims}


def run_case(case: Case, target: Target, slot: Slot, executor: LocalExecutor | SSHExecutor | None = None,
             bench_lock: threading.Lock | None = None, share: int = 1, baselines: Baselines | None = None) -> Row:
    """One case through the pipeline, its stages in one session on `executor` (default: the slot's
    own); its bench stage, and its first (where the session measures the bench stage's baselines),
    hold `bench_lock` when one is given; it may allocate 1/`share` of the usual device memory.
    `baselines`: the run's, shared by its cases (gpu_pool/baselines.py)."""
    target = target_for(case, target)
    executor = executor or executor_for(slot)
    # The runaway cases prove the memory limit with a smaller one; no gate reads the torch.compile
    # baseline, and compiling it is most of a bench stage.
    jobs = {stage: replace(job, rules=replace(job.rules, memory_mb=case.memory_mb or job.rules.memory_mb,
                                              compile_baseline=False,
                                              gpu_memory_fraction=job.rules.gpu_memory_fraction / share))
            for stage, job in jobs_for(case.candidate(), target, slot).items()}

    def run_stage(stage: str, job, slot: Slot, timeout_s: float, session):
        # The session measures the bench stage's baselines in its first stage: the lock holds both.
        with bench_lock if bench_lock is not None and stage in ("bench", next(iter(jobs))) else nullcontext():
            return session.run(job, slot, timeout_s)

    charge = Charge()
    verdict = run_stages(case.candidate(), target, slot, run_stage, charge, jobs, baselines, executor.session)
    return Row(case, verdict, charge.gpu_seconds)


def run_gauntlet(cases: list[Case], target: Target, slot: Slot,
                 progress: Callable[[Row], None] = lambda row: None, jobs: int = 1,
                 executor: LocalExecutor | SSHExecutor | None = None) -> list[Row]:
    """Every case, `jobs` at a time (see the module's docstring); rows in the order of `cases`,
    `progress` called as each finishes. On KeyboardInterrupt no further case starts; the ones
    in flight finish (a second Ctrl-C abandons them) and the exception goes on."""
    executor = executor or executor_for(slot)
    store = Baselines()
    if jobs <= 1:
        rows = []
        for case in cases:
            rows.append(run_case(case, target, slot, executor, baselines=store))
            progress(rows[-1])
        return rows
    lock = threading.Lock()
    done: dict[int, Row] = {}
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="gauntlet") as pool:
        pending = {pool.submit(run_case, c, target, slot, executor, lock, jobs, store): i
                   for i, c in enumerate(cases) if not c.alone}
        try:
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    done[pending.pop(future)] = row = future.result()
                    progress(row)
        except KeyboardInterrupt:
            running = sum(not f.cancel() for f in pending)
            print(f"interrupted: no new case starts; waiting for the {running} in flight "
                  "(Ctrl-C again to abandon them)", file=sys.stderr)
            for future in pending:
                if not future.cancelled():
                    progress(future.result())
            raise
    for i, case in enumerate(cases):  # alone: nothing else runs meanwhile
        if case.alone:
            done[i] = row = run_case(case, target, slot, executor, baselines=store)
            progress(row)
    return [done[i] for i in sorted(done)]


def table(rows: list[Row], on_gpu: bool) -> str:
    """Markdown: one line per case, red team first; `ok` says the verdict was the expected one."""
    lines = ["| suite | vector | candidate | expected | got | ok | s | note |",
             "| --- | --- | --- | --- | --- | --- | ---: | --- |"]
    for r in sorted(rows, key=lambda r: r.case.honest):
        c = r.case
        note = c.note
        if not r.ok and r.verdict.failing_gate is not None:  # what a person needs to see why
            detail = r.verdict.failing_gate.detail.replace("|", "/").replace("\n", " ")[:300]
            note = (note + "; " if note else "") + f"got: {detail}"
        if not on_gpu and c.vector in ("hidden work", "timer patching") and "GPU" not in note:
            note = (note + "; " if note else "") + "stream/event paths need a GPU"
        lines.append(f"| {'honest' if c.honest else 'red team'} | {c.vector} | `{c.name}` | {c.expected} | "
                     f"{r.got} | {'yes' if r.ok else '**NO**'} | {r.seconds:.0f} | {note} |")
    red = [r for r in rows if not r.case.honest]
    honest = [r for r in rows if r.case.honest]
    lines.append("")
    lines.append(f"red team rejected as expected: {sum(r.ok for r in red)}/{len(red)}; "
                 f"honest passed: {sum(r.ok for r in honest)}/{len(honest)}"
                 + ("" if on_gpu else "; no GPU: speed-of-light and the GPU timing paths are not exercised"))
    return "\n".join(lines)
