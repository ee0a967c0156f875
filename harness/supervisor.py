"""The trusted side of a candidate's stages: screen, plan, run the sandbox, judge, return the verdicts.

The candidate never runs in this process. The supervisor screens the source, hashes the
harness's files, starts `harness.sandbox` (its own process, scratch directory, memory limit, no
network where the OS allows; a fork of this one when it may fork, harness/processes.py), draws
the seeds, and reads its report. Values are judged here against the float64 oracle on inputs
this process redraws itself from the same seeds, so the expected outputs exist only where the
candidate cannot reach them. One sandbox serves a candidate's session, its stages in order
(`Session`); a stage on its own is a session of one (`supervise`). Each stage's verdict is made
here and handed to the caller, never written by the sandbox; the session's last one after the
sandbox and everything it started are dead.
"""
from __future__ import annotations

import ctypes
import io
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from contract.job import Job
from contract.verdict import PASS, Verdict
from harness import caches, processes
from harness.deadline import Deadline, kill, kill_descendants
from harness.limits import MemoryWatchdog
from harness.screen import screen

WORKER_ROOT = Path(__file__).resolve().parent.parent
WATCHED_TREES = ("harness", "engine_templates", "contract")
PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE = 36, 4


def supervise(job: Job, scratch: Path) -> Verdict:
    """One stage on its own: a session of that one stage."""
    session = Session(scratch, [job.stage], bench=job if job.stage == "bench" else None)
    try:
        return session.stage(job)
    finally:
        session.close()


class Session:
    """One candidate's stages (`stages`, in order) in one sandbox, which lives until the last of
    them, or the first that does not pass. When the session holds the bench stage (`bench`, its
    job), the sandbox measures the baselines, or checks them for drift, before the candidate is
    loaded: at the session's first stage, under the bench stage's own limit. Each stage is judged
    by a judge of its own, under its own limit; its verdict is this process's, returned to the
    caller, never written by the sandbox."""

    def __init__(self, scratch: Path, stages: list[str], bench: Job | None = None, private: bool = False):
        """`private`: once the sandbox runs, make this process not dumpable, so that no other
        process of its user opens its descriptors (a session's channel) through /proc."""
        self.scratch, self.stages, self.bench, self.private = scratch, stages, bench, private
        self.trees = [WORKER_ROOT / t for t in WATCHED_TREES]
        self.sandbox: Sandbox | None = None
        self.bench_judge = None
        self.before: dict[str, str] = {}
        self.done: list[str] = []  # the stages run so far
        self.over = False  # ended: a stage did not pass, or the last one ran

    def stage(self, job: Job) -> Verdict:
        v = Verdict(op=job.candidate.op, candidate_id=job.candidate.id, stages=[job.stage])
        t0 = time.perf_counter()
        if self.over or self.stages[len(self.done):len(self.done) + 1] != [job.stage]:
            # Each stage once, in the session's order: a request out of it was not the controller's.
            v.crash("harness", f"the {job.stage} stage was asked of a session of {self.stages} after "
                               f"{self.done or 'none'}{' (ended)' if self.over else ''}")
            self.close()
            return v
        self.done.append(job.stage)
        if job.candidate.kind == "free" and not _screened(job, v):
            self.close()
            return v
        from harness.integrity import tree_changes, tree_digest

        first = self.sandbox is None
        if first:
            self.before = tree_digest(self.trees)
            # From here this process writes no bytecode into the watched trees: every change is the
            # candidate's. The sandbox starts now, before this process starts a thread or draws a
            # seed: a fork of it when it is a warm fork itself (of the fork server), else a fresh
            # interpreter that imports torch while this process does the same. It gets its first
            # request only once the judge has made the plan.
            sys.dont_write_bytecode = True
            caches.prune_free()
            if device := _device_known(job):
                self.sandbox = Sandbox(job, self.scratch, device)
        deadline = Deadline(job.limit_s, t0)
        if self.sandbox:
            self.sandbox.watch(deadline)
        try:
            from harness.judging import Judge

            baselines_first = first and self.bench is not None
            if job.stage == "bench" and self.bench_judge is not None and job != self.bench:
                v.crash("harness", "the bench stage's job is not the one whose baselines the session measured")
                self.close()
                return v
            if job.stage == "bench" and self.bench_judge is not None:
                # Its plan drawn, its baselines read and its verdict begun before the candidate loaded.
                judge = self.bench_judge
                judge.v.flags, v = v.flags, judge.v
            else:
                judge = Judge(job, v, sources=self.before)
            if self.sandbox is None:
                self.sandbox = Sandbox(job, self.scratch, judge.device)
                self.sandbox.watch(deadline)
            sandbox = self.sandbox
            if first:  # before the sandbox's first request: one call's outputs of any of the session's stages
                from harness.judging import output_bytes

                sandbox.size_staging(max(judge.output_bytes, output_bytes(self.bench) if self.bench else 0))
            elif judge.output_bytes > sandbox.staging.size:
                v.crash("harness", f"the {job.stage} stage's outputs may take {judge.output_bytes} bytes a call; "
                                   f"the session's staging buffer holds {sandbox.staging.size}")
                self.close()
                return v
            if first and self.private:  # after the fork: the sandbox stays dumpable, as a fresh process is
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            if baselines_first:
                if job.stage == "bench":
                    bench_judge, bench_deadline = judge, deadline
                else:  # the stage's limit counts from the baselines' end; theirs is the bench stage's
                    deadline.cancel()
                    bench_deadline = Deadline(self.bench.limit_s, time.perf_counter())
                    bench_judge = Judge(self.bench, Verdict(op=self.bench.candidate.op, candidate_id=self.bench.candidate.id,
                                                            stages=["bench"]), sources=self.before)
                self.bench_judge = bench_judge
                try:
                    measured = self._baselines(bench_judge, bench_deadline, v)
                finally:
                    if bench_deadline is not deadline:  # the bench stage's own limit runs on
                        bench_deadline.cancel()
                if not measured:
                    v.wall_s = time.perf_counter() - t0
                    return v
                if job.stage != "bench":
                    deadline = Deadline(job.limit_s, time.perf_counter())
                sandbox.watch(deadline)
            sandbox.request(job, judge.plan)
            sent = time.perf_counter()
            sandbox.read(judge, deadline)
            ended = (v.status != PASS or not judge.done or deadline.struck or job.stage == self.stages[-1]
                     or sandbox.watchdog.tripped is not None)
        finally:
            deadline.cancel()
        if ended:
            self._end_sandbox()
            if sandbox.watchdog.tripped:
                judge.memory_exceeded(sandbox.watchdog.tripped)
        self._integrity(v, tree_changes(self.before, tree_digest(self.trees)))
        judge.finish(sandbox.proc.returncode if ended else None, deadline)
        v.wall_s = time.perf_counter() - t0
        v.device["sandbox_start"] = sandbox.how
        v.device["sandbox"] = f"pid {sandbox.proc.pid}, stage {len(self.done)} of its session"
        v.device["staging"] = sandbox.staging.describe()
        points = [("prepare", t0)] + ([("sandbox_start", sandbox.started_at)] if first else [])
        if baselines_first:
            points.append(("isolation", self.bench_judge.marks.get("isolation", time.perf_counter())))
        elif first and "isolation" in judge.marks:
            points.append(("isolation", judge.marks["isolation"]))
        loading = judge.marks.get("loading", sent)
        points += [("loading", loading if loading >= t0 else sent),
                   *[(k, at) for k, at in judge.marks.items() if k == "done"], ("end", time.perf_counter())]
        _note_phases(v, job.stage, points)
        if ended:
            self.over = True
        return v

    def _baselines(self, judge, deadline: Deadline, v: Verdict) -> bool:
        """The bench stage's baselines, or their drift check, before the candidate loads, read by
        the bench stage's `judge` under `deadline`; False when they failed (then `v` says how, and
        the session is over)."""
        self.sandbox.watch(deadline)
        self.sandbox.request(self.bench, judge.plan, part="baselines")
        self.sandbox.read(judge, deadline, until="loading")
        if judge.v.status == PASS and "loading" in judge.marks and not deadline.struck:
            return True
        self.close()
        if self.sandbox.watchdog.tripped:
            judge.memory_exceeded(self.sandbox.watchdog.tripped)
        judge.finish(self.sandbox.proc.returncode, deadline)
        if judge.v is not v:  # the session's first stage is not the bench: its verdict says it
            v.merge(judge.v)
            v.stages = v.stages[:1]
        return False

    def _integrity(self, v: Verdict, changes: list[str]) -> None:
        if changes:
            _remove_planted(changes)
            v.gate("harness_integrity", False, f"the harness's files changed while the candidate ran: "
                                               f"{'; '.join(changes[:5])}")

    def _end_sandbox(self) -> None:
        self.over = True
        if self.sandbox is not None and not self.sandbox.ended:
            self.sandbox.end()

    def close(self) -> None:
        """End the sandbox and all it started; bytecode it planted in the harness's trees goes."""
        ended_here = self.sandbox is not None and not self.sandbox.ended
        self._end_sandbox()
        if ended_here and self.before:
            from harness.integrity import tree_changes, tree_digest

            _remove_planted(tree_changes(self.before, tree_digest(self.trees)))


def _device_known(job: Job) -> str | None:
    """The job's device, where it is known without touching CUDA here (`auto` only where this
    process was forked from a fork server that learned the GPU): the sandbox is forked before
    anything touches CUDA in this process."""
    if job.device != "auto":
        return job.device
    from harness.device import known

    return known(job.device)


def _note_phases(v: Verdict, stage: str, points: list[tuple[str, float]]) -> None:
    """Seconds of each part of the stage, as far as it got: preparing (screening, hashing,
    starting the sandbox), the sandbox's start (to its first frame), the baselines (until the
    candidate loads), the candidate (loading it, and the stage's work) and the end."""
    names = {"isolation": "baselines", "loading": "candidate", "done": "finish"}
    for (name, at), (_, until) in zip(points, points[1:]):
        v.phases[f"{stage}/{names.get(name, name)}"] = until - at


def _screened(job: Job, v: Verdict) -> bool:
    try:
        found = screen(job.candidate.source or "", dtype=job.rules.dtype)
    except SyntaxError:
        return True  # the load gate reports it, with the line
    if found.rejections:
        v.gate("screen", False, "; ".join(str(f) for f in found.rejections))
        return False
    v.flags = sorted({f.rule for f in found.flags})
    if job.stage == "compile":  # once per candidate, not once per stage
        v.gate("screen", True, "; ".join(f"flag {f}" for f in found.flags) or "nothing to flag")
    return True


def _sandbox_env() -> dict[str, str]:
    env = processes.clean_env(os.environ)
    env["PYTHONPATH"] = str(WORKER_ROOT)
    # The sandbox writes no bytecode: every change under the harness's trees is the candidate's.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class _Report(io.RawIOBase):
    """The report channel's read end: read as it comes, and at its end once `deadline` says
    that reading is over, whatever still holds a write end."""

    def __init__(self, fd: int, deadline: Deadline):
        self.fd, self.deadline = fd, deadline  # the deadline of the stage being read
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.deadline.reading_over():
            if self._poll.poll(100):  # data, or the end: no write end left
                n = os.readv(self.fd, [buffer])
                if n == 0:
                    self.deadline.report_ended()
                return n
        return 0

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


class Sandbox:
    """The candidate's process: started with its limits, then given each request (a job and its
    plan) as a line of stdin (the sandbox imports torch before the first, unless it is a warm
    fork), its report read up to each request's last frame, until `end`."""

    def __init__(self, job: Job, scratch: Path, device: str | None = None):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the sandbox stay ours to kill
        self.job, self.device = job, device or job.device
        home = scratch / "sandbox"
        home.mkdir(exist_ok=True)
        self.read_fd, w = os.pipe()
        # The staging buffer the outputs cross in (harness/channel.py): this process's, made before
        # the sandbox so that it inherits it; sized and sealed before its first request.
        self.staging_fd = os.memfd_create("infersmith-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.staging = None
        # A supervisor started fresh (not by the fork server) starts a fresh sandbox at once, which
        # imports torch while this process does: importing first and then forking would do the
        # two one after the other.
        why = processes.why_not_fork() or processes.not_warm()
        self.warm = not why
        if self.warm:
            self.proc = _fork_sandbox(home, w, self.staging_fd)
        else:
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "harness.sandbox", str(w), str(self.staging_fd)],
                                         cwd=home, env=_sandbox_env(), stdin=subprocess.PIPE,
                                         pass_fds=(w, self.staging_fd))
        self.how = "a fork of the supervisor" if self.warm else f"a fresh interpreter ({why})"
        self.started_at = time.perf_counter()
        os.close(w)
        self.deadline: Deadline | None = None
        self.watchdog: MemoryWatchdog | None = None
        self._write({"device": self.device, "memory_mb": job.rules.memory_mb})
        self.ended, self.cuda_ready = False, False
        self.report = _Report(self.read_fd, None)
        self.stream = io.BufferedReader(self.report)

    def watch(self, deadline: Deadline) -> None:
        """Held to `deadline` (a stage's limit) from now, and to the memory limit for its life
        (threads of this process: started only once the sandbox was forked)."""
        self.deadline = deadline
        deadline.watch(self.proc.pid)
        if self.watchdog is None:
            self.watchdog = MemoryWatchdog(self.proc.pid, self.job.rules.memory_mb, lambda: kill(self.proc.pid))

    def _write(self, line: dict) -> None:
        self._write_raw(json.dumps(line).encode() + b"\n")

    def _write_raw(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # it died (or stdin is closed at its end); its exit status says how

    def size_staging(self, size: int) -> None:
        """Give the staging buffer its size, once, before the sandbox's first request."""
        from harness.channel import Staging

        self.staging = Staging(self.staging_fd, size)

    def _answer(self, word: str) -> bool:
        """Answer a `settle` frame (`go`) or an output frame (`taken`), never blocking: were the
        candidate's process to send such frames and leave the answers unread (a fork holding
        stdin), a blocking write would stop the judge, and with it the verdict, until a kill.
        False when the pipe is full."""
        fd = self.proc.stdin.fileno()  # everything before the answers was flushed in run()
        os.set_blocking(fd, False)
        try:
            os.write(fd, word.encode() + b"\n")  # at most PIPE_BUF bytes: written whole or not at all
        except BlockingIOError:
            return False
        except BrokenPipeError:
            pass  # it died; its exit status says how
        return True

    def request(self, job: Job, plan: dict, part: str = "") -> None:
        """Hand over a stage's job and plan (`part` "baselines": the bench stage's baselines only)."""
        self._write({"job": job.to_json(), "plan": plan, "caches": caches.for_stage(job), "part": part,
                     "gpu_memory_fraction": job.rules.gpu_memory_fraction})
        if self.device == "cuda" and job.stage != "compile" and not self.cuda_ready:
            # This process judges on the device: its CUDA context is made now, beside the
            # sandbox's own, not on the way to the job (the compile stage judges nothing there).
            import torch

            torch.zeros((), device="cuda")
            self.cuda_ready = True
            self.staging.pin()  # the judge copies each output from it to the device: DMA

    def read(self, judge, deadline: Deadline, until: str = "done") -> None:
        """Read the report into `judge` until the sandbox sends `until`, fails a gate, or ends;
        the sandbox is killed when the stage did not pass. stdin stays open: the bench stage waits
        on it before timing each shape (`settle`), and the session's next stage comes on it."""
        self.report.deadline = deadline
        judge.read(self.stream, stop=lambda: kill(self.proc.pid), go=lambda: self._answer("go"), until=until,
                   killed=lambda: deadline.struck or self.watchdog.tripped is not None, staging=self.staging,
                   taken=lambda: self._answer("taken"))

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.deadline:
            self.deadline.cancel()
        kill(self.proc.pid)
        self.proc.wait()
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # the process is gone; nothing was left to flush
        if self.watchdog:
            self.watchdog.stop()
        kill_descendants()
        self.stream.close()
        os.close(self.staging_fd)  # its mapping, and the judge's copies, stay this process's


def _fork_sandbox(home: Path, report_w: int, staging: int) -> processes.Forked:
    """The sandbox as a fork of this process, set up as `python -P -m harness.sandbox FD STAGING`
    would be: stdin a pipe from here, the report channel at FD, the staging buffer at STAGING, the
    sandbox's environment, this process's directory off the import path."""
    stdin_r, stdin_w = os.pipe()
    path = [p for p in sys.path if p not in ("", os.getcwd())]

    def run() -> int:
        from harness import sandbox

        sys.path[:] = path
        sys.argv = ["python -m harness.sandbox", str(report_w), str(staging)]
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # a reader of its own on the new stdin
        return sandbox.main()

    pid = processes.fork(run, {0: stdin_r, 1: 1, 2: 2, report_w: report_w, staging: staging}, str(home),
                         _sandbox_env())
    os.close(stdin_r)
    return processes.Forked(pid, os.fdopen(stdin_w, "wb"))


def _remove_planted(changes: list[str]) -> None:
    """Bytecode the candidate added or touched is a cache, always safe to delete, and must go so
    that the next run does not import it. Added source files are deleted only in a shipped
    bundle: in a checkout (the local pool) a new file may be a person's work. The verdict names
    every change either way."""
    in_checkout = (WORKER_ROOT / ".git").exists()
    for change in changes:
        how, _, path = change.partition(" ")
        cache = "__pycache__" in Path(path).parts
        if (how in ("added", "changed") and cache) or (how == "added" and not in_checkout):
            Path(path).unlink(missing_ok=True)
