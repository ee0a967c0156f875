"""Process limits for the sandbox: memory, core dumps, network.

Applied by the sandbox to itself first thing, while it is one thread and has imported
nothing heavy. Memory is capped twice: RLIMIT_AS on CPU-only runs (CUDA reserves huge
virtual ranges, so on a GPU it would break the driver; there torch's per-process memory
fraction caps device memory instead), and on every run the supervisor's watchdog kills the
sandbox when its resident memory passes the limit.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import threading
import time

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
# Virtual memory beyond the resident limit that a CPU process legitimately reserves
# (thread stacks, allocator arenas, the libraries' mappings).
VIRTUAL_HEADROOM_MB = 8192


def cap_memory(memory_mb: int, cpu_only: bool) -> str:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not cpu_only:
        return f"resident memory watched at {memory_mb} MiB; device memory capped by torch's memory fraction"
    limit = (memory_mb + VIRTUAL_HEADROOM_MB) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return f"resident memory watched at {memory_mb} MiB; address space capped at {limit >> 20} MiB"


def _unshare(flags: int) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return 0 if libc.unshare(flags) == 0 else ctypes.get_errno()


def _map_own_ids(uid: int, gid: int) -> None:
    """In a fresh user namespace, keep our own uid/gid (files we create stay ours)."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def drop_network(allow_user_namespace: bool) -> str:
    """Move into an empty network namespace where the OS allows it; say what happened."""
    if not os.path.exists("/proc/self/ns/net"):
        return "network: not isolated (no network namespaces on this OS); screened statically only"
    err = _unshare(CLONE_NEWNET)
    if err == 0:
        return "network: none (own empty network namespace)"
    if allow_user_namespace:  # unprivileged: a user namespace of our own grants the right
        uid, gid = os.getuid(), os.getgid()
        if _unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            try:
                _map_own_ids(uid, gid)
                return "network: none (own user and network namespace)"
            except OSError as e:
                return f"network: none (own network namespace; ids unmapped: {e.strerror})"
    return f"network: not isolated ({os.strerror(err)}); screened statically only"


def resident_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass  # the process is gone or hides its status: nothing left to watch
    return 0.0


class MemoryWatchdog:
    """Kills `pid` when its resident memory passes `limit_mb`; `tripped` says it did."""

    def __init__(self, pid: int, limit_mb: int, kill, period_s: float = 0.05):
        self.pid, self.limit_mb, self._kill, self.period_s = pid, limit_mb, kill, period_s
        self.tripped: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            rss = resident_mb(self.pid)
            if rss > self.limit_mb:
                self.tripped = rss
                self._kill()
                return
            time.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
