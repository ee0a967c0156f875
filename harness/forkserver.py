"""`python -P -B -m harness.forkserver FD`: the warm interpreter every stage process is forked from.

It imports torch, Triton, the ops and the harness once (harness/processes.py); on a GPU slot it
learns what the GPU is from a child of its own (harness/device.py) and has Triton and Inductor
hash their installed files (their cache keys); it never touches a GPU itself and never runs a
candidate, then answers requests on FD, a Unix socket whose other end only its
starter holds (gpu_pool/warm.py): each request names a stage's directory and arguments and
brings its stdout, stderr, a status socket, and any descriptors it hands on as 3, 4, … (a
session's request and reply pipes). For each, it forks a supervisor — in a session of
its own, in that directory, running `python -m harness ARGS` — and replies with its pid; when
that process exits, its exit code is written to the status socket, which is then closed. A fork
changes nothing here: what a stage does stays in its own address space.

The first message says whether it is ready (`{"ready": true}`), or why it cannot serve (a
process that CUDA was initialised in cannot hand a device to its forks). It exits when FD
closes: its starter is gone. Stages already started run to their own end.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys

from harness import processes

MAX_REQUEST = 1 << 16
MAX_EXTRA_FDS = 2


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        processes.warm_up()
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            from harness.device import learn

            learn()  # else each stage asks CUDA itself, as a supervisor started fresh does
            processes.hash_compilers()
        why = processes.why_not_fork()
    except Exception as e:  # an import that fails here fails in every stage too, where it is reported
        why = f"importing the harness failed: {type(e).__name__}: {e}"
    try:
        sock.sendall(json.dumps({"ready": not why, "why": why, "pid": os.getpid()}).encode())
    except OSError:  # its starter is gone already: nothing to serve
        return 0
    if why:
        return 1
    gc.freeze()  # the imports' objects stay out of the collector's sweeps: forks copy fewer pages
    serve(sock)
    return 0


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    status: dict[int, int] = {}  # child pid -> its status socket (the end that writes)
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            while _drained(wake_r):
                pass
        if sock in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 3 + MAX_EXTRA_FDS)
            except ConnectionError:
                data, fds = b"", []
            if not data:
                break
            pid = _start(json.loads(data), fds)
            status[pid] = fds[2]
            try:
                sock.sendall(json.dumps({"pid": pid}).encode())
            except OSError:  # the starter is gone: the stage runs to its own end, unwatched
                break
        _reap(status)
    for fd in status.values():
        os.close(fd)


def _start(request: dict, fds: list[int]) -> int:
    """Fork a supervisor for the request; this process keeps only the status socket."""
    out, err, extra = fds[0], fds[1], fds[3:]

    def run() -> int:
        from harness.__main__ import main as harness_main

        sys.argv = ["python -m harness", *request["argv"]]
        return harness_main(request["argv"])

    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        return processes.fork(run, {0: devnull, 1: out, 2: err, **{3 + i: fd for i, fd in enumerate(extra)}},
                              request["cwd"], new_session=True)
    finally:
        for fd in (devnull, out, err, *extra):
            os.close(fd)


def _reap(status: dict[int, int]) -> None:
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        fd = status.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, f"{os.waitstatus_to_exitcode(raw)}\n".encode())
            except OSError:
                pass  # the starter stopped listening: it no longer needs the code
            os.close(fd)


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # nothing to finalise, and the imports' extension modules would complain at exit
