"""Run one stage of one candidate in a subprocess on this machine, under a time limit; or a
candidate's stages in one session, one supervisor and one sandbox for them all."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from contract.job import Job
from contract.verdict import PASS, Verdict
from gpu_pool import warm
from gpu_pool.pool import Slot
from harness.processes import clean_env

# The folder holding harness/ and engine_templates/: what a worker needs on its PYTHONPATH.
WORKER_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class StageRun:
    verdict: Verdict
    slot: Slot
    held_s: float  # seconds the slot (its GPU) was held by this stage


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class LocalExecutor:
    """Each stage is a `python -m harness` process in its own session and scratch dir: a fork of
    the warm fork server (gpu_pool/warm.py) unless `warm` is off or that server cannot serve,
    else a fresh interpreter."""

    def __init__(self, python: str = sys.executable, scratch_root: Path | None = None,
                 worker_root: Path = WORKER_ROOT, warm: bool = True):
        self.python = python
        self.scratch_root = scratch_root
        self.worker_root = worker_root  # harness/ and engine_templates/: this checkout, or an unpacked bundle
        self.warm = warm

    def env(self, slot: Slot) -> dict[str, str]:
        """The stage's environment: only what a sandbox may have (nothing of the controller's
        credentials), since the sandbox is a fork of the stage's process and can read it."""
        env = clean_env(os.environ) | {"PYTHONPATH": str(self.worker_root), "PYTHONUNBUFFERED": "1"}
        if slot.gpu is None:
            env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu)
        return env

    def prewarm(self, slot: Slot) -> None:
        """Start the slot's fork server now, so that its imports overlap whatever comes first."""
        if self.warm:
            warm.server_for(self.python, self.worker_root, self.env(slot))

    def close(self) -> None:
        """Stop the fork servers of this executor's worker root, before that folder goes."""
        warm.stop(self.worker_root)

    def run(self, job: Job, slot: Slot, timeout_s: float) -> StageRun:
        scratch = Path(tempfile.mkdtemp(prefix=f"infersmith-{job.candidate.id}-{job.stage}-",
                                        dir=self.scratch_root))
        (scratch / "job.json").write_text(job.limited(timeout_s).to_json())
        env = self.env(slot)
        out = scratch / "verdict.json"
        argv = ["job.json", "--out", str(out)]
        t0 = time.monotonic()
        with open(scratch / "stdout.log", "wb") as so, open(scratch / "stderr.log", "wb") as se:
            server = warm.server_for(self.python, self.worker_root, env) if self.warm else None
            proc = server.start(argv, scratch, so, se) if server else None
            if proc is None:
                proc = _Fresh(subprocess.Popen([self.python, "-m", "harness", *argv], cwd=scratch, env=env,
                                               stdout=so, stderr=se, start_new_session=True))
            try:
                rc = proc.wait(timeout_s)
            finally:  # a timeout, a cancelled flow, Ctrl-C: never leave the group running
                proc.kill_group()
        held = time.monotonic() - t0
        # The harness exits 0 once it wrote its verdict; a file there after any other end was not
        # its (a candidate can write beside the harness's files), and would pass on as its record.
        text = out.read_text() if rc == 0 and out.exists() else None
        verdict = verdict_from(job, text, rc, timeout_s, _tail(scratch / "stderr.log"))
        verdict.phases[f"{job.stage}/start"] = max(0.0, held - verdict.wall_s) if text else 0.0
        shutil.rmtree(scratch, ignore_errors=True)
        return StageRun(verdict, slot, held)


    def session(self, slot: Slot, jobs: dict[str, Job], limits: dict[str, float]) -> LocalSession:
        """A session for one candidate's `jobs` (its stages, in order), each under its limit in `limits`."""
        return LocalSession(self, slot, jobs, limits)


def session_key() -> bytes:
    """A session's key: sent to its supervisor first, before its sandbox exists; its replies are signed with it."""
    return os.urandom(32)


def signed_reply(key: bytes, line: bytes) -> str | None:
    """The verdict's JSON of a reply line signed under `key` (harness/__main__.py); None when the
    line is not one: written by something else than the session's supervisor."""
    mac, _, body = line.partition(b" ")
    good = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    return body.decode() if hmac.compare_digest(mac, good) else None


class LocalSession:
    """One candidate's stages in one `python -m harness session` on this machine (harness/__main__.py):
    its jobs written before it starts, started at the first stage, asked for each stage in turn on a
    Unix socket that only it and this process hold, its verdicts read from the same socket. It ends
    after the last stage or the first that does not pass; `close` ends it in any case, and removes
    its scratch directory."""

    def __init__(self, executor: LocalExecutor, slot: Slot, jobs: dict[str, Job], limits: dict[str, float]):
        self.executor, self.slot, self.limits = executor, slot, limits
        self.jobs = {stage: job.limited(limits[stage]) for stage, job in jobs.items()}
        candidate = next(iter(jobs.values())).candidate
        self.scratch = Path(tempfile.mkdtemp(prefix=f"infersmith-{candidate.id}-session-",
                                             dir=executor.scratch_root))
        (self.scratch / "session.json").write_text(json.dumps({"jobs": {s: j.to_json() for s, j in self.jobs.items()}}))
        self.proc = None
        self.channel: socket.socket | None = None
        self._logs: list = []
        self._replies = b""
        self.key = session_key()
        self.ended = False

    def _start(self) -> None:
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = self.executor.env(self.slot)
        so, se = open(self.scratch / "stdout.log", "wb"), open(self.scratch / "stderr.log", "wb")
        self._logs = [so, se]
        server = warm.server_for(self.executor.python, self.executor.worker_root, env) if self.executor.warm else None
        try:
            self.proc = server.start(["session", "session.json", "--channel", "3"], self.scratch, so, se,
                                     (theirs.fileno(),)) if server else None
            if self.proc is None:
                self.proc = _Fresh(subprocess.Popen([self.executor.python, "-m", "harness", "session", "session.json",
                                                     "--channel", str(theirs.fileno())], cwd=self.scratch, env=env,
                                                    stdout=so, stderr=se, pass_fds=(theirs.fileno(),),
                                                    start_new_session=True))
        finally:
            theirs.close()  # the supervisor holds the other end alone
        self.channel.sendall((json.dumps({"key": self.key.hex()}) + "\n").encode())

    def __enter__(self) -> LocalSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, job: Job, slot: Slot, timeout_s: float) -> StageRun:
        """The stage's verdict, from the session's supervisor; a crash when it does not come in
        time (the session is then killed) or the supervisor ended without it."""
        t0 = time.monotonic()
        first = self.proc is None
        job = job.limited(timeout_s)
        if self.jobs.get(job.stage) != job:
            raise ValueError(f"the {job.stage} job is not the one this session was opened with")
        text, rc = None, -1  # a session already ended has no verdict to give
        if not self.ended:
            if first:
                self._start()
            # The first stage waits for the bench stage's baselines too, measured before the candidate loads.
            bench_first = first and "bench" in self.jobs and job.stage != "bench"
            text, rc = self._ask(job.stage, timeout_s + (self.limits["bench"] if bench_first else 0.0))
        held = time.monotonic() - t0
        verdict = verdict_from(job, text, rc, timeout_s, _tail(self.scratch / "stderr.log"))
        if text is not None and (verdict.stages != [job.stage] or verdict.candidate_id != job.candidate.id):
            verdict = verdict_from(job, None, 1, timeout_s, f"the session replied for {verdict.stages} of "
                                                            f"{verdict.candidate_id!r}")
        verdict.phases[f"{job.stage}/start"] = max(0.0, held - verdict.wall_s) if text else 0.0
        if text is None or verdict.status != PASS:
            self.close()
        return StageRun(verdict, slot, held)

    def _ask(self, stage: str, wait_s: float) -> tuple[str | None, int | None]:
        """The reply to this request and 0; else None and how the supervisor ended: None when the
        limit passed (the session is then killed), its exit code when it ended without a reply."""
        try:
            self.channel.sendall((json.dumps({"stage": stage}) + "\n").encode())
        except OSError:
            return None, self._ended_code()
        deadline = time.monotonic() + wait_s
        while b"\n" not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.channel], [], [], left)[0]:
                self.proc.kill_group()  # past the limit: the supervisor, the sandbox and all they started
                self.ended = True
                return None, None
            try:
                chunk = self.channel.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                return None, self._ended_code()
            self._replies += chunk
        line, self._replies = self._replies.split(b"\n", 1)
        text = signed_reply(self.key, line)
        if text is None:
            self.proc.kill_group()
            self.ended = True
            return None, 1
        return text, 0

    def _ended_code(self) -> int:
        """The exit code of a supervisor that ended its side without a reply."""
        self.ended = True
        rc = self.proc.wait(30)
        if rc is None:
            self.proc.kill_group()
            rc = self.proc.returncode
        return rc if rc is not None else -signal.SIGKILL

    def close(self) -> None:
        """End the session (its supervisor ends its sandbox first), and remove its scratch directory."""
        if self.channel is not None:
            try:
                self.channel.shutdown(socket.SHUT_WR)  # the requests end: the supervisor ends the session
            except OSError:
                pass  # its end is closed already: it exited
            if self.proc.wait(30) is None:
                self.proc.kill_group()
            self.proc.kill_group()  # whatever the candidate left in the session's process group
            self.channel.close()
            self.channel = None
        self.ended = True
        for f in self._logs:
            f.close()
        self._logs = []
        shutil.rmtree(self.scratch, ignore_errors=True)


class _Fresh:
    """A stage started as a fresh interpreter, handled as warm.Started is."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.pid = proc, proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def wait(self, timeout_s: float | None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill_group(self) -> None:
        """Kill the whole session, also what the candidate left behind after the harness exited."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def verdict_from(job: Job, verdict_json: str | None, rc: int | None, timeout_s: float, log: str) -> Verdict:
    """The stage's verdict: the harness's own, or a crash saying how its process ended.

    rc is None when the time limit killed the process; verdict_json is None when none was written.
    """
    if rc is not None and verdict_json is not None:
        v = Verdict.from_json(verdict_json)
        v.log_tail = v.log_tail or log
        return v
    v = Verdict(op=job.candidate.op, candidate_id=job.candidate.id, stages=[job.stage], log_tail=log)
    if rc is None:
        v.crash("time_limit", f"{job.stage} stage ran past its {timeout_s:g} s limit and was killed")
    else:
        how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        v.crash("process", f"the {job.stage} process died ({how}) without a verdict; "
                           f"last log line: {log.strip().splitlines()[-1] if log.strip() else '(none)'}")
    return v
