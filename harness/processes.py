"""How the harness starts its processes warm.

Warm: a fork of an interpreter that has already imported torch, Triton, the ops and the harness,
and has never touched a GPU. Importing those takes seconds (more than the work of a small
stage), and a process started fresh pays it again; a fork pays nothing. It is a copy of its
parent in an address space of its own, and these rules keep it as clean as a fresh interpreter:
- the parent has never initialised CUDA (a fork cannot use a device its parent opened), which
  `cuda_untouched` checks, and is one thread (a lock another thread held would stay held in
  the copy);
- the parent holds nothing the child must not see: the fork server never runs a candidate, the
  supervisor forks its sandbox before it draws a seed or computes an expected output, and the
  environment the parent was started with (which /proc/self/environ shows its forks) holds only
  the variables a sandbox may have (`clean_env`; `environ_clean` checks);
- the child closes every descriptor it was not given, takes the environment it is given, and
  never returns into its parent's code: it ends with `os._exit`.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import traceback
from typing import Callable

# What a stage process inherits from the environment: enough for torch, Triton and CUDA; no
# credentials the controller's environment may hold.
ENV_KEEP = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "PYTHONUNBUFFERED",
            "PYTHONDONTWRITEBYTECODE", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "OMP_NUM_THREADS",
            "INFERSMITH_CACHE", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR")
ENV_KEEP_PREFIXES = ("TRITON_", "NVIDIA_", "CUDA_")
# Everything a stage imports before it runs a candidate, on either side of it. Inductor's config
# too: torch.use_deterministic_algorithms, which every call of a candidate goes through, imports it.
WARM_MODULES = ("torch", "torch._inductor.config", "triton", "engine_templates.ops", "engine_templates.ceilings",
                "harness.channel", "harness.checks", "harness.device", "harness.integrity", "harness.judging",
                "harness.limits", "harness.load", "harness.sandbox", "harness.screen", "harness.stages",
                "harness.supervisor", "harness.timing", "harness.__main__", "harness.baselines", "harness.caches")


def warm_up() -> None:
    """Import every module of WARM_MODULES (nothing is done for those already imported)."""
    for name in WARM_MODULES:
        importlib.import_module(name)


def hash_compilers() -> None:
    """Triton's and Inductor's keys of their own installed files (libtriton is hundreds of MB),
    computed once here: each is cached in the process, and every fork inherits it."""
    from torch._inductor.codecache import torch_key
    from triton.runtime.cache import triton_key

    triton_key()
    torch_key()


def not_warm() -> str:
    """'' when this process has imported every module of WARM_MODULES; else which it has not."""
    missing = [name for name in WARM_MODULES if name not in sys.modules]
    return f"this process has not imported {', '.join(missing[:3])}" if missing else ""


def clean_env(environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k in ENV_KEEP or k.startswith(ENV_KEEP_PREFIXES)}


def environ_clean() -> bool:
    """Whether this process was started with a clean environment (its forks can read that one)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            names = [entry.split(b"=", 1)[0].decode(errors="replace") for entry in f.read().split(b"\0") if entry]
    except OSError:
        return False
    return all(n in ENV_KEEP or n.startswith(ENV_KEEP_PREFIXES) for n in names)


def cuda_untouched() -> str:
    """'' when this process may fork children that use a GPU; else why not. The CUDA driver
    library is mapped once anything initialised it (torch, Triton, a probe); unmapped, nothing did."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialised CUDA in this process"
    try:
        with open("/proc/self/maps") as f:
            if any("libcuda.so" in line for line in f):
                return "the CUDA driver library is loaded in this process"
    except OSError:
        return "this OS has no /proc/self/maps to check that CUDA is untouched"
    return ""


def why_not_fork() -> str:
    """'' when this process may fork a warm stage process now; else why not."""
    if not hasattr(os, "fork"):
        return "this OS cannot fork"
    if not environ_clean():
        return "this process was started with more than a stage's environment"
    if threading.active_count() > 1:
        return f"{threading.active_count()} threads run in this process"
    return cuda_untouched()


class Forked:
    """A forked child as the harness handles a subprocess.Popen: pid, stdin, wait, returncode."""

    def __init__(self, pid: int, stdin=None):
        self.pid, self.stdin, self.returncode = pid, stdin, None

    def wait(self) -> int:
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped elsewhere (the subreaper's sweep): its code is lost
                self.returncode = -signal.SIGKILL
        return self.returncode


def fork(run: Callable[[], int], keep: dict[int, int], cwd: str, env: dict[str, str] | None = None,
         new_session: bool = False) -> int:
    """Fork a child that runs `run()` and exits with its code. `keep` maps the child's descriptor
    numbers to this process's descriptors (0, 1, 2 and any other it needs); every other
    descriptor is closed in the child. `env`: the child's whole environment (None: this one's)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _become_child(keep, cwd, env, new_session)
        code = run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the child's own failure: said on its stderr, its exit code says the rest
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream: nothing more can be said through it
        os._exit(code)


def _become_child(keep: dict[int, int], cwd: str, env: dict[str, str] | None, new_session: bool) -> None:
    if new_session:
        os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Moved out of the way first, so that placing one cannot overwrite another still to be placed.
    high = {target: os.dup(source) for target, source in keep.items()}
    for target, source in high.items():
        os.dup2(source, target)
    _close_all_but(set(keep))
    os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)


def _close_all_but(kept: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):  # listed before closing: the listing's own fd goes too
        fd = int(name)
        if fd not in kept:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, already closed


