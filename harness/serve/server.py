"""An OpenAI-compatible server as a child process group: started, waited for, stopped cleanly,
its output kept in a log file; and several replicas of one behind a load balancer."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from contract.serve import ServerError

POLL_S = 0.5


def free_ports(n: int) -> list[int]:
    """n distinct ports free right now: all are held until the last is chosen."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ServerProcess:
    def __init__(self, label: str, argv: list[str], log_path: Path, env: dict[str, str], port: int,
                 ready_path: str = "/v1/models"):
        self.label, self.argv, self.log_path, self.env, self.port = label, argv, log_path, env, port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> ServerProcess:
        """Starts it and waits until GET <ready_path> answers 200."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Starts it; the exact command line beside its log (server.log: server.command)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.with_suffix(".command").write_text(shlex.join(self.argv) + "\n")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise ServerError(f"{self.label} exited with code {self.proc.returncode} while starting; "
                                  f"log: {self.log_tail(300)}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(POLL_S)
        raise ServerError(f"{self.label} did not answer {self.ready_path} within {timeout_s:g} s; "
                          f"log: {self.log_tail(300)}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to its process group, SIGKILL after grace_s; nothing it started is left."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc.wait()
        try:  # what the server left in its group after it exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


BALANCER_START_S = 60.0  # it answers once every replica does, and they already do


class Replicas:
    """Copies of one server, each its own process, port (argv_for(replica, port)) and log, behind
    a load balancer process (harness/serve/balancer.py) when there are several; `url` is where
    clients go. One replica is the server alone, logged to server.log; several log to
    server-<i>.log, the balancer to balancer.log."""

    def __init__(self, label: str, argv_for: Callable[[int, int], list[str]], envs: list[dict[str, str]],
                 out: Path, python: str, ready_path: str = "/v1/models"):
        n = len(envs)
        ports = free_ports(n + (n > 1))
        if n == 1:
            self.servers = [ServerProcess(f"{label} server", argv_for(0, ports[0]), out / "server.log", envs[0],
                                          ports[0], ready_path)]
        else:
            self.servers = [ServerProcess(f"{label} replica {i} (of {n})", argv_for(i, ports[i]),
                                          out / f"server-{i}.log", envs[i], ports[i], ready_path) for i in range(n)]
        self.balancer = None
        if n > 1:
            backends = [arg for s in self.servers for arg in ("--backend", s.url)]
            self.balancer = ServerProcess(f"{label} load balancer", [python, "-m", "harness.serve.balancer", "--port",
                                          str(ports[n]), *backends], out / "balancer.log",
                                          {**envs[0], "CUDA_VISIBLE_DEVICES": ""}, ports[n])
        self.url = (self.balancer or self.servers[0]).url

    @property
    def processes(self) -> list[ServerProcess]:
        return self.servers + ([self.balancer] if self.balancer else [])

    def start(self, timeout_s: float) -> Replicas:
        """Every replica at once (each loads its model meanwhile), then the balancer; all answer within timeout_s."""
        deadline = time.monotonic() + timeout_s
        for s in self.servers:
            s.launch()
        for s in self.servers:
            s.wait_ready(max(deadline - time.monotonic(), POLL_S))
        if self.balancer:
            self.balancer.start(BALANCER_START_S)
        return self

    @property
    def alive(self) -> bool:
        return all(p.alive for p in self.processes)

    def dead(self) -> ServerProcess | None:
        """The first process (replica or balancer) that has exited, if any."""
        return next((p for p in self.processes if p.proc is not None and not p.alive), None)

    def death(self, when: str) -> str | None:
        """Which process exited `when`, with its code and its log's name; None while all live."""
        p = self.dead()
        return None if p is None else f"the {p.label} exited with code {p.proc.returncode} {when}; its log is " \
                                      f"kept ({p.log_path.name})"

    def log_tail(self, n: int = 4000) -> str:
        """The log of the process that died, else the first replica's."""
        return (self.dead() or self.servers[0]).log_tail(n)

    def stop(self) -> None:
        for p in reversed(self.processes):  # the balancer first: no request reaches a stopping replica
            p.stop()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
