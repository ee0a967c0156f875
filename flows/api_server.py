"""A command's own Prefect API server, where no PREFECT_API_URL names one: Prefect's ephemeral
application (`create_app(ephemeral=True)`: no UI, only the services a lone flow needs) in a
uvicorn process of its own, which ends with the command.

Prefect would start the same application itself on the flow's first call, after importing its
server's modules into the command's process (1.6 s there). Started here, before anything heavy is
imported, the server's process imports them on another core while the command imports its own.
The listening socket is bound here, on a port the kernel picks, and handed to uvicorn: clients
may connect at once (they wait in its backlog until the app is up) and no two commands race for
a port. The server's process ends when the command's does, however it ends: it stops once its
stdin, a pipe only the command holds open, reaches its end. Flows find the server through
PREFECT_API_URL, set for the command's flows alone (`using`); `is_own` tells it apart from a
server someone runs, where a person could answer.

In its own process: `python -m flows.api_server FD`, FD the listening socket.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

STARTUP_TIMEOUT_S = 90.0


class APIServerError(RuntimeError):
    """The command's server did not start: one line for the command to print (cli/main.py)."""

STARTUP_FAILED = 3  # the server's exit code when Prefect's application did not start (as uvicorn's)
ROOT = Path(__file__).resolve().parents[1]


def app():
    """The uvicorn factory, called in the server's process."""
    from prefect.server.api.server import create_app

    return create_app(ephemeral=True, final=True)


def serve(fd: int) -> int:
    """The server's process: Prefect's application on the inherited socket `fd` until stdin ends.
    The socket is handed to uvicorn as the TCP socket it is: uvicorn's `--fd` opens any descriptor
    as a Unix socket, and the TCP connections it accepts then wait on Nagle's algorithm (40 ms a
    request)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config("flows.api_server:app", factory=True, lifespan="on", log_level="error"))

    def watch_stdin() -> None:
        # unbuffered: a daemon thread blocked in a buffered read aborts the interpreter's exit
        while os.read(0, 4096):
            pass  # the command writes nothing: this ends once its end of the pipe is closed
        server.should_exit = True

    threading.Thread(target=watch_stdin, name="command-gone", daemon=True).start()
    server.run(sockets=[socket.socket(fileno=fd)])
    return 0 if server.started else STARTUP_FAILED


class CommandServer:
    """The server's process, started at construction; `ready()` waits until it answers."""

    def __init__(self) -> None:
        from prefect.settings import get_current_settings

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True)}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            self.log = tempfile.TemporaryFile()  # what it says: read back if it fails to start or dies
            self.proc = subprocess.Popen([sys.executable, "-m", "flows.api_server", str(sock.fileno())],
                                         pass_fds=(sock.fileno(),), env=env, stdin=subprocess.PIPE, stdout=self.log,
                                         stderr=self.log)
        finally:
            sock.close()  # the server's copy listens on: connections wait for it
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        atexit.register(self.stop)

    def ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait for its health check, then make its first API request (half a second: the routes'
        first use), so that the flow's first call does not pay it. A server that exits or does not
        answer in time raises APIServerError with the end of what it wrote."""
        import httpx

        try:
            with httpx.Client(timeout=timeout_s) as client:
                client.get(f"{self.api_url}/health").raise_for_status()
                client.get(f"{self.api_url}/admin/version").raise_for_status()
        except httpx.HTTPError as e:
            self.stop()
            said = self.said()
            raise APIServerError(f"Prefect's API server for this command did not start ({type(e).__name__}: {e})"
                               + (f": {said}" if said else "")) from None

    def said(self) -> str:
        """The last error the server wrote (the exception's line, not uvicorn's note that the
        application did not start), else its last line."""
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().decode(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
        return (errors or lines or [""])[-1]

    def stop(self) -> None:
        """End the server's process; one that had ended on its own with an error says why, on stderr."""
        if self.proc.poll() is None:
            self.proc.stdin.close()  # its watch ends it; terminate if that does not
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        elif self.proc.returncode not in (0, STARTUP_FAILED) and not self.proc.stdin.closed:
            print(f"infersmith: Prefect's API server for this command ended with code {self.proc.returncode} "
                  f"before the command did: {self.said()}", file=sys.stderr)
        if not self.proc.stdin.closed:
            self.proc.stdin.close()


_lock = threading.Lock()
_server: CommandServer | None = None


def start() -> CommandServer:
    """This process's server, started on the first call."""
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = CommandServer()
        return _server


def is_own(url: str | None) -> bool:
    """Whether `url` is this process's own server (no person can reach it), not one someone runs."""
    return url is not None and _server is not None and url.rstrip("/") == _server.api_url


@contextlib.contextmanager
def using(server: CommandServer) -> Iterator[None]:
    """Flows run in the block talk to `server`. They send no heartbeats: heartbeats serve to find
    crashed runs later, and this server ends with the command (Prefect's heartbeat thread sleeps in
    steps of a second, and the flow's end waits for the step). No link to a UI is printed: the
    server has none."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_UI_URL,
        temporary_settings,
    )

    # an empty UI URL, not None: None is inferred from the API's, and the flow would link to it
    with temporary_settings({PREFECT_API_URL: server.api_url, PREFECT_UI_URL: "",
                             PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
