"""The platform on one machine (`infersmith up`): a Prefect server, an MLflow tracking server and a
worker of the deployments' process work pool, real ones, with the deployments registered.

The stack's record, stack.json under the tracking home, names every process it started (cli/
processes.py), so that `infersmith down`, from any terminal, stops those and nothing else; and
gives the servers' URLs, so that `infersmith` commands on this machine use them by default
(running()) — their runs then show in both UIs, and GPU leases of a killed flow expire, which
only a real Prefect server's services do.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cli.processes import Started, start, start_ticks, stop

RECORD = "stack.json"


class PortInUse(Exception):
    """A port the stack needs is taken; one line naming it."""


class StackError(Exception):
    """The stack could not start; one line, and what had started is stopped again."""


@dataclass(frozen=True)
class StackSettings:
    home: Path
    work_pool: str  # the deployments' work pool, which the worker serves
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    prefect_database: str | None = None  # default: SQLite under <home>/prefect
    mlflow_database: str | None = None  # default: the embedded store, <home>/mlflow.db
    artifacts: str | None = None  # s3://bucket/prefix, or default <home>/artifacts
    start_timeout_s: float = 300.0  # the servers' first start migrates their databases

    @property
    def address(self) -> str:
        """Where browsers and workers reach the servers: the host, or this machine's name when
        they listen on every interface."""
        return socket.getfqdn() if self.host in ("0.0.0.0", "::") else self.host

    @property
    def prefect_ui(self) -> str:
        return f"http://{self.address}:{self.prefect_port}"

    @property
    def prefect_api(self) -> str:
        return f"{self.prefect_ui}/api"

    @property
    def mlflow_ui(self) -> str:
        return f"http://{self.address}:{self.mlflow_port}"

    @property
    def s3(self) -> str | None:
        return self.artifacts if self.artifacts and self.artifacts.startswith("s3://") else None


def check_ports(s: StackSettings) -> None:
    for what, port in (("Prefect server", s.prefect_port), ("MLflow server", s.mlflow_port)):
        with socket.socket() as sock:
            # as the servers bind: a port whose last connections linger in TIME_WAIT is free to them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((s.host, port))
            except OSError as e:
                raise PortInUse(f"port {port} on {s.host} (for the {what}) is in use: {e.strerror}") from None
    if s.prefect_port == s.mlflow_port:
        raise PortInUse(f"the Prefect and MLflow servers cannot share port {s.prefect_port}")


def _record_path(home: Path) -> Path:
    return home / RECORD


def running(home: Path) -> dict | None:
    """The record of the stack whose `up` runs now with this tracking home, else None."""
    try:
        record = json.loads(_record_path(home).read_text())
    except (OSError, ValueError):
        return None
    up = record.get("up", {})
    return record if up and Started("up", up.get("pid", 0), up.get("ticks", -1), "").alive() else None


def environment(record: dict) -> dict[str, str]:
    """What a command on this machine sets to use the stack: its Prefect API, MLflow and S3."""
    env = {"PREFECT_API_URL": record["prefect_api"], "MLFLOW_TRACKING_URI": record["mlflow"]}
    return env | ({"INFERSMITH_S3_URI": record["s3"]} if record.get("s3") else {})


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _python_tool(name: str) -> str:
    """The console script of this environment's package (mlflow), wherever its python lives."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise StackError(f"no `{name}` command beside {sys.executable} or on PATH")
    return found


class Stack:
    def __init__(self, s: StackSettings):
        self.s, self.home = s, s.home.resolve()
        self.started: list[Started] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.record = {"up": {"pid": os.getpid(), "ticks": start_ticks(os.getpid())}, "prefect_api": s.prefect_api,
                       "prefect_ui": s.prefect_ui, "mlflow": s.mlflow_ui, "s3": s.s3, "processes": []}

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        started, proc = start(name, argv, env, self.home / "logs" / f"{name}.log")
        self.started.append(started)
        self.procs[name] = proc
        self.record["processes"].append(started.to_dict())
        self._write()  # at once: a `down` after this `up` is killed still finds what it started

    def _write(self) -> None:
        tmp = _record_path(self.home).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1))
        tmp.replace(_record_path(self.home))

    def _wait(self, name: str, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.s.start_timeout_s
        while not ready():
            if self.procs[name].poll() is not None:
                raise StackError(f"the {name} exited with code {self.procs[name].returncode}: see "
                                 f"{self.home / 'logs' / name}.log")
            if time.monotonic() > deadline:
                raise StackError(f"the {name} did not {what} within {self.s.start_timeout_s:g} s: "
                                 f"see {self.home / 'logs' / name}.log")
            time.sleep(0.5)

    def up(self, deploy: Callable[[str], list[str]], online: Callable[[str, str], bool]) -> list[str]:
        """Start the servers, register the deployments through `deploy(prefect_api)`, start the
        worker and wait until `online(prefect_api, worker_name)`; the deployments' names. On any
        failure what started is stopped again."""
        s, home = self.s, self.home
        home.mkdir(parents=True, exist_ok=True)
        base = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        base.pop("PREFECT_API_URL", None)  # the stack's own, not one inherited from elsewhere
        try:
            prefect_db = s.prefect_database or f"sqlite+aiosqlite:///{home / 'prefect' / 'prefect.db'}"
            (home / "prefect").mkdir(exist_ok=True)
            self._start("prefect-server", [sys.executable, "-m", "prefect", "server", "start", "--host", s.host,
                                           "--port", str(s.prefect_port)],
                        {**base, "PREFECT_HOME": str(home / "prefect"), "PREFECT_UI_API_URL": s.prefect_api,
                         "PREFECT_SERVER_DATABASE_CONNECTION_URL":
                             prefect_db.replace("postgresql://", "postgresql+asyncpg://", 1)})
            # One uvicorn process: with more, its supervisor kills a child slow to start (a loaded
            # machine) and starts another, over and over.
            mlflow_db = s.mlflow_database or f"sqlite:///{home / 'mlflow.db'}"
            artifacts = f"{s.s3}/mlflow" if s.s3 else s.artifacts or str(home / "artifacts")
            self._start("mlflow-server", [_python_tool("mlflow"), "server", "--backend-store-uri", mlflow_db,
                                          "--artifacts-destination", artifacts, "--host", s.host,
                                          "--port", str(s.mlflow_port), "--workers", "1"],
                        # MLflow's job runner (seven consumer processes) serves GenAI jobs, none of ours
                        {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **base})
            self._wait("prefect-server", lambda: _healthy(f"{s.prefect_api}/health"), f"answer {s.prefect_api}")
            self._wait("mlflow-server", lambda: _healthy(f"{s.mlflow_ui}/health"), f"answer {s.mlflow_ui}")
            names = deploy(s.prefect_api)
            worker_env = {**base, **environment(self.record), "INFERSMITH_HOME": str(home)}
            worker = f"{socket.gethostname()}-{os.getpid()}"
            self._start("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", s.work_pool,
                                   "--type", "process", "--name", worker], worker_env)
            self._wait("worker", lambda: online(s.prefect_api, worker), f"join work pool {s.work_pool}")
        except BaseException:
            self.down()
            raise
        return names

    def watch(self) -> str:
        """Block until one of the processes exits; its name."""
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    return name
            time.sleep(0.5)

    def down(self) -> None:
        stop(self.started)
        _record_path(self.home).unlink(missing_ok=True)


def stop_recorded(home: Path, grace_s: float = 60.0) -> list[str]:
    """`infersmith down`: ask the running `up` to stop its stack, then stop whatever the record
    still names (an `up` that was killed cannot); the names of what was recorded."""
    path = _record_path(home)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    up = record.get("up", {})
    leader = Started("up", up.get("pid", 0), up.get("ticks", -1), "")
    if up and leader.alive():
        os.kill(leader.pid, signal.SIGTERM)  # its handler stops the servers in order and removes the record
        deadline = time.monotonic() + grace_s
        while leader.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
    started = [Started(**p) for p in record.get("processes", [])]
    stop(started)
    path.unlink(missing_ok=True)
    return [p.name for p in started]
