"""The stage's time limit as the harness keeps it, and the kill of everything the sandbox
started: the supervisor arms it, the judge reads from it whether the limit struck."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


def reserve_s(limit_s: float) -> float:
    """How long before the controller's limit the harness stops the candidate: time to kill
    the sandbox, check the trees and write the verdict, and for this process's own start."""
    return max(2.0, min(10.0, 0.1 * limit_s))


class Deadline:
    """The stage's limit as the harness keeps it: `reserve_s` inside the controller's, so that a
    candidate that runs too long is killed here and the verdict keeps what was judged and timed
    before (the controller's kill writes none). No limit when the job has none."""

    def __init__(self, limit_s: float | None, t0: float):
        self.limit_s, self.t0 = limit_s, t0
        self.expired_after: float | None = None  # seconds from t0, once the limit struck
        self.ended_first = False  # the report had ended (every write end closed) before it struck
        self._pid: int | None = None
        self._over = False
        self._lock = threading.Lock()
        self._timer = None
        if limit_s is not None:
            self._timer = threading.Timer(max(0.0, limit_s - reserve_s(limit_s) - (time.perf_counter() - t0)),
                                          self._expire)
            self._timer.daemon = True
            self._timer.start()

    def watch(self, pid: int) -> None:
        with self._lock:
            self._pid = pid
            if self.expired_after is not None:
                kill(pid)

    def _expire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.expired_after = time.perf_counter() - self.t0
            if self._pid is not None:  # not reaped before cancel(): the pids are still theirs
                kill(self._pid)
                kill_tree()

    def report_ended(self) -> None:
        """The report's end was read: the sandbox and all it started are gone. Should the limit
        strike before the supervisor cancels it, their end was their own, not the limit's. (A
        sandbox that exits while a fork it left holds the channel has not ended the report.)"""
        with self._lock:
            if self.expired_after is None:
                self.ended_first = True

    def cancel(self) -> None:
        with self._lock:
            self._over = True
        if self._timer:
            self._timer.cancel()

    @property
    def struck(self) -> bool:
        """Whether the limit struck (and the sandbox was killed for it)."""
        return self.expired_after is not None

    def reading_over(self) -> bool:
        """Once the limit struck: whether the report has been read for a quarter of the reserve since.
        What is not in by then is not judged, so that a process the kill missed (one forked
        while `kill_tree` looked, as a chain of forks always is), still holding the channel,
        cannot keep the judge reading into the controller's kill."""
        return (self.struck
                and time.perf_counter() - self.t0 >= self.limit_s - 3 * reserve_s(self.limit_s) / 4)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc."""
    out = {}
    # listdir, not Path.glob: glob stats each entry, and a process that exits in between raises
    # ESRCH from there (outside any handler here), which crashed the harness on a loaded host.
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            out[int(name)] = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
    return out


def kill_tree() -> None:
    """Kill, without reaping, every process below this one: the sandbox and what it started
    (still its children, or re-parented to us). Unreaped, none of their pids can be reused
    before `kill_descendants` waits for them. Their deaths close every copy of the report
    channel's write end, so that the judge's read ends."""
    parents, below, me = _parents(), [], os.getpid()
    level = [pid for pid, parent in parents.items() if parent == me]
    while level:
        below += level
        level = [pid for pid, parent in parents.items() if parent in level and pid not in below]
    # Parents before children: a shell whose child was killed first could return from `wait`
    # and exit on its own before its kill (seen in CI: the test's shell exited 0, not -9).
    for pid in below:
        kill(pid)


def kill_descendants() -> None:
    """Everything the sandbox left behind (re-parented to us as the subreaper)."""
    me = os.getpid()
    for _ in range(3):
        children = [pid for pid, parent in _parents().items() if parent == me]
        for pid in children:
            kill(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # reaped already
        if not children:
            return
