"""One OpenAI-compatible server as a child process group: started, waited for, stopped cleanly,
its output kept in a log file."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_S = 0.5


class ServerError(Exception):
    """The server did not come up, or went away; the message names why and ends in its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, label: str, argv: list[str], log_path: Path, env: dict[str, str], port: int):
        self.label, self.argv, self.log_path, self.env, self.port = label, argv, log_path, env, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> ServerProcess:
        """Starts it and waits until GET /v1/models answers 200."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise ServerError(f"{self.label} server exited with code {self.proc.returncode} while starting; "
                                  f"log: {self.log_tail(300)}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(POLL_S)
        raise ServerError(f"{self.label} server did not answer /v1/models within {timeout_s:g} s; "
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
