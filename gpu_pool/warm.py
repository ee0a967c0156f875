"""Warm starts for stages on this machine: the fork servers (harness/forkserver.py) they start from.

One fork server per interpreter, worker root, environment and version of the worker's sources,
started on first use (or ahead of it by `prewarm`, so that its imports overlap the controller's
own start) and stopped when the controller exits, or when the sources it imported change. Each
stage is a fork of it in a session of its own (then the candidate's sandbox a fork of that,
harness/supervisor.py): no stage pays for importing torch, and none shares an address space with
another. Its socket is private to this process; no stage process holds an end of it.

A fork server that cannot serve (it could not import the harness, or something initialised CUDA
in it) is not asked again: its stages start as fresh interpreters, as they would without it.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import threading
from pathlib import Path

WORKER_PACKAGES = ("harness", "engine_templates")
READY_TIMEOUT_S = 300.0  # the server's imports, on a loaded machine
REPLY_TIMEOUT_S = 60.0
MAX_REPLY = 1 << 16


class Started:
    """A stage process the fork server started: its pid (and session), and its exit code when it ends."""

    def __init__(self, pid: int, status_fd: int):
        self.pid, self._fd, self.returncode = pid, status_fd, None

    def wait(self, timeout_s: float | None) -> int | None:
        """Its exit code; None if it still runs after `timeout_s`."""
        if self.returncode is None:
            if not select.select([self._fd], [], [], timeout_s)[0]:
                return None
            data = b""
            while chunk := os.read(self._fd, 64):
                data += chunk
            os.close(self._fd)
            # Nothing written: the fork server died first, and its code is lost with it.
            self.returncode = int(data) if data.strip() else -signal.SIGKILL
        return self.returncode

    def kill_group(self) -> None:
        """Kill its session (the stage and whatever it left behind), and wait for its end."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the session is empty already
        self.wait(None)


class ForkServer:
    def __init__(self, python: str, worker_root: Path, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([python, "-P", "-B", "-m", "harness.forkserver", str(theirs.fileno())],
                                     cwd="/", env=dict(env, PYTHONPATH=str(worker_root)), stdin=subprocess.DEVNULL,
                                     pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.sock, self.why = ours, ""
        self._ready: bool | None = None
        self.served = False  # it said it was ready: should it die, another is started
        self._lock = threading.Lock()

    def _is_ready(self) -> bool:
        if self._ready is None:
            reply = self._receive(READY_TIMEOUT_S)
            self._ready = self.served = bool(reply and reply.get("ready"))
            self.why = "" if self._ready else (reply or {}).get("why") or "the fork server ended while starting"
        return self._ready

    def _receive(self, timeout_s: float) -> dict | None:
        if not select.select([self.sock], [], [], timeout_s)[0]:
            return None
        try:
            data = self.sock.recv(MAX_REPLY)
        except OSError:
            return None
        return json.loads(data) if data else None

    def start(self, argv: list[str], cwd: Path, stdout, stderr, extra_fds: tuple[int, ...] = ()) -> Started | None:
        """`python -m harness ARGV` in `cwd`, forked, with `extra_fds` as its descriptors 3, 4, …;
        None when this server cannot start it."""
        with self._lock:
            if not self._is_ready():
                return None
            # The exit status comes on a socket, not a pipe: another process of this user can open a
            # pipe of this one again through /proc/PID/fd and write a status (0: "the harness wrote its
            # verdict") that its stage never ended with; a socket cannot be opened so.
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            r = ours.detach()
            try:
                socket.send_fds(self.sock, [json.dumps({"argv": argv, "cwd": str(cwd)}).encode()],
                                [stdout.fileno(), stderr.fileno(), theirs.fileno(), *extra_fds])
                reply = self._receive(REPLY_TIMEOUT_S)
            except OSError:
                reply = None
            finally:
                theirs.close()
            if not reply or "pid" not in reply:
                os.close(r)
                self._ready, self.why = False, "the fork server stopped answering"
                return None
            return Started(reply["pid"], r)

    def close(self) -> None:
        self.sock.close()  # its end of the socket reads EOF: it exits
        if not self.served:  # still importing, or it could not serve: nothing of it to wait for
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_servers: dict[tuple, ForkServer] = {}
_lock = threading.Lock()


def server_for(python: str, worker_root: Path, env: dict[str, str]) -> ForkServer:
    """The fork server for these; a new one when none is running, or the sources changed since."""
    base = (python, str(worker_root), tuple(sorted(env.items())))
    key = (*base, sources_stamp(worker_root))
    with _lock:
        server = _servers.get(key)
        if server is None or (server.proc.poll() is not None and server.served):
            for old in [k for k in _servers if k[:3] == base]:
                _servers.pop(old).close()
            server = _servers[key] = ForkServer(python, worker_root, env)
        return server


def sources_stamp(root: Path) -> tuple:
    """Path, size and modification time of every source file of the worker packages."""
    out = []
    for package in WORKER_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if "__pycache__" not in path.parts and path.suffix != ".pyc" and path.is_file():
                st = path.stat()
                out.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(out)


def stop(worker_root: Path) -> None:
    """Stop the fork servers of this worker root (one about to be deleted, say)."""
    with _lock:
        for key in [k for k in _servers if k[1] == str(worker_root)]:
            _servers.pop(key).close()


@atexit.register
def stop_all() -> None:
    with _lock:
        while _servers:
            _servers.popitem()[1].close()
