"""Run one stage of one candidate in a subprocess on this machine, under a time limit."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from contract.job import Job
from contract.verdict import Verdict
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


class _Fresh:
    """A stage started as a fresh interpreter, handled as warm.Started is."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.pid = proc, proc.pid

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
