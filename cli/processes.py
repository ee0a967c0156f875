"""The processes `infersmith up` starts, told apart from every other process of the machine.

Each server starts as the leader of a session of its own. A record names it by pid and start
time (clock ticks since boot, from /proc), so that a pid the kernel gave to someone else since
is never signalled. What a leader started counts as its own: its process group (MLflow's job
consumers stay in it after their parent exits) and its descendants (Prefect's worker starts each
flow run in a session of its own).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state, ppid, pgrp, ...), None for a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"  # a zombie has exited; only its parent's wait is due


@dataclass(frozen=True)
class Started:
    name: str
    pid: int
    ticks: int  # the leader's start time: with pid, names it for good
    log: str

    def alive(self) -> bool:
        """Running, and the process recorded, not a later one with its pid; a zombie has exited."""
        return _running(self.pid) and start_ticks(self.pid) == self.ticks

    def to_dict(self) -> dict:
        return asdict(self)


def start(name: str, argv: list[str], env: dict[str, str], log: Path) -> tuple[Started, subprocess.Popen]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    ticks = start_ticks(proc.pid)
    return Started(name, proc.pid, ticks if ticks is not None else -1, str(log)), proc


def _table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgrp, start ticks) of every process now."""
    out = {}
    for entry in os.scandir("/proc"):  # listed directly: a process may exit mid-scan
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields:
                out[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[19]))
    return out


def family(s: Started) -> list[int]:
    """The pids that are the leader's: itself while it lives, its group's members started no earlier
    than it, and the descendants of all of those."""
    table = _table()
    own = {pid for pid, (_, pgrp, ticks) in table.items() if pgrp == s.pid and ticks >= s.ticks}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, _) in table.items() if ppid in own} - own
        own |= more
        grew = bool(more)
    return sorted(own)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop(started: list[Started], grace_s: float = 10.0) -> None:
    """SIGTERM to every leader's family (last started first), SIGKILL to what is left after grace_s:
    Prefect's worker, for one, forwards a first SIGTERM as an interrupt it may not finish handling."""
    pids = [pid for s in reversed(started) for pid in family(s)]
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        _reap(pids)
        time.sleep(0.2)
    _signal([p for p in pids if _running(p)], signal.SIGKILL)
    _reap(pids)


def _reap(pids: list[int]) -> None:
    """Collect this process's own exited children, so that they do not linger as zombies."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
