"""The pool over real SSH: OpenSSH servers on loopback ports, each a "host" with its own host
key and workdir, reached with a generated client key. Candidates run under Triton's interpreter."""
from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flows.optimize_op import optimize_op
from flows.target import Target
from gpu_pool.bundle import current_bundle
from gpu_pool.health import HEALTH, HostFault
from gpu_pool.pool import Host, Pool
from gpu_pool.ssh import connect, ensure_bundle, workdir_of
from tracking.history import search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

SSHD = Path("/usr/sbin/sshd")
pytestmark = pytest.mark.skipif(not SSHD.exists(), reason="needs an OpenSSH server at /usr/sbin/sshd "
                                                          "(.ci/run installs openssh-server)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@dataclass
class SSHServer:
    name: str
    port: int
    root: Path
    host_key_pub: str
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(self.root / "sshd_config")],
                                     stdout=subprocess.DEVNULL, stderr=open(self.root / "sshd.log", "ab"))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"sshd {self.name} did not listen: {(self.root / 'sshd.log').read_text()}")

    def kill(self) -> None:
        """The host drops: the daemon, its connections and everything they started die."""
        doomed = _descendants(self.proc.pid) + [self.proc.pid]
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class Loopback:
    servers: list[SSHServer]
    client_key: Path
    known_hosts: Path
    root: Path

    def host(self, server: SSHServer, **extra) -> Host:
        return Host(name=server.name, address="127.0.0.1", port=server.port, user=getpass.getuser(),
                    key_file=self.client_key, known_hosts=self.known_hosts, python=sys.executable,
                    workdir=str(self.root / f"work-{server.name}"), usd_per_gpu_hour=1.0, **extra)


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssh")
    client_key = root / "client_key"
    authorized = root / "authorized_keys"
    authorized.write_text(_keygen(client_key) + "\n")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    servers = []
    for name in ("loop-a", "loop-b"):
        d = root / name
        d.mkdir()
        port = _free_port()
        pub = _keygen(d / "host_key")
        (d / "sshd_config").write_text("\n".join([
            f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host_key'}",
            f"AuthorizedKeysFile {authorized}", "StrictModes no", "UsePAM no", f"PidFile {d / 'sshd.pid'}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp", "LogLevel ERROR", ""]))
        servers.append(SSHServer(name, port, d, pub))
    known = root / "known_hosts"
    known.write_text("".join(f"[127.0.0.1]:{s.port} {' '.join(s.host_key_pub.split()[:2])}\n" for s in servers))
    for s in servers:
        s.start()
    yield Loopback(servers, client_key, known, root)
    for s in servers:
        if s.proc and s.proc.poll() is None:
            s.kill()


def test_a_host_key_that_does_not_match_known_hosts_is_refused(loopback, tmp_path):
    a, b = loopback.servers
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{a.port} {' '.join(b.host_key_pub.split()[:2])}\n")
    host = loopback.host(a).model_copy(update={"known_hosts": wrong})
    with pytest.raises(HostFault, match="does not match"):
        connect(host)
    # A changed key is refused even where unknown keys would be trusted.
    with pytest.raises(HostFault, match="does not match"):
        connect(host.model_copy(update={"trust_unknown_host_key": True}))


def test_an_unknown_host_is_refused_unless_the_pool_entry_trusts_it(loopback, tmp_path):
    a = loopback.servers[0]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    host = loopback.host(a).model_copy(update={"known_hosts": empty})
    with pytest.raises(HostFault, match="unknown"):
        connect(host)
    connect(host.model_copy(update={"trust_unknown_host_key": True})).close()
    assert f"[127.0.0.1]:{a.port}" in empty.read_text()  # recorded: the next contact checks it
    connect(host).close()


def test_the_bundle_is_sent_once_per_content(loopback):
    host = loopback.host(loopback.servers[1]).model_copy(update={"workdir": str(loopback.root / "fresh")})
    client = connect(host)
    try:
        workdir = workdir_of(client, host)
        first, sent_first = ensure_bundle(client, host, workdir)
        again, sent_again = ensure_bundle(client, host, workdir)
    finally:
        client.close()
    assert (sent_first, sent_again) == (True, False) and first == again
    assert Path(first).name == current_bundle().digest
    assert (Path(first) / "harness" / "__main__.py").exists()


def test_pool_check_reports_each_host_and_an_unreachable_one_as_a_row(loopback, tmp_path, capsys):
    from flows.cli import main

    a = loopback.servers[0]
    pool_file = tmp_path / "pool.yaml"
    hosts = [loopback.host(a).model_dump(mode="json"),
             loopback.host(a).model_copy(update={"name": "gone", "port": _free_port()}).model_dump(mode="json")]
    import yaml
    pool_file.write_text(yaml.safe_dump({"hosts": hosts}))
    assert main(["pool", "check", "--pool", str(pool_file), "--stage-timeout", "120"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["host", "address", "class", "status"]
    row_a = next(line for line in out if line.startswith("loop-a"))
    row_gone = next(line for line in out if line.startswith("gone"))
    assert " ok " in row_a and "none (CPU)" in row_a and "ok (compile" in row_a
    assert "unreachable: cannot connect" in row_gone


def test_a_sweep_across_hosts_survives_one_dropping_mid_candidate(loopback, prefect_server, tracking_home):
    """Two hosts, three candidates at once where slots allow; host a's sshd dies while a candidate
    runs there. Every candidate ends judged, none on two slots at once, the dropped one retried on b."""
    a, b = loopback.servers
    pool = Pool(hosts=[loopback.host(a), loopback.host(b)])
    runs_a = Path(pool.hosts[0].workdir) / "runs"

    def kill_a_once_busy():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if runs_a.exists() and any((d / "sid").exists() for d in runs_a.iterdir()):
                a.kill()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_once_busy, daemon=True)
    killer.start()
    target = Target(model="tiny", dtype="fp32", budget={"candidates": 3, "stage_timeout_s": 120})
    try:
        result = optimize_op(op="rmsnorm", target=target, proposer="random", seed=11, pool=pool)
    finally:
        killer.join(timeout=1)
        HEALTH._benched.clear()
    assert a.proc.poll() is not None, "host a was never seen busy, so never killed"

    tracker = Tracker(TrackingConfig.from_env())
    children = [r for r in search(tracker, "rmsnorm") if r.data.tags.get("mlflow.parentRunId") == result["parent_run_id"]]
    assert len(children) == 3 and len({c.data.tags[f"{T}candidate_id"] for c in children}) == 3
    assert all(c.data.tags[f"{T}status"] in ("pass", "fail", "crash") for c in children)
    retried = [c for c in children if c.data.metrics["host_attempts"] == 2]
    assert len(retried) == 1 and retried[0].data.tags[f"{T}host"] == "loop-b"
    assert retried[0].data.tags[f"{T}status"] == "pass"
    for c in children:
        assert c.data.tags[f"{T}gpu_class"] == "cpu" and c.data.tags[f"{T}gpu_index"] == ""
        assert c.data.metrics["gpu_seconds"] > 0
        assert c.data.metrics["cost_usd"] == pytest.approx(c.data.metrics["gpu_seconds"] / 3600)

    held = [(slot, t0, t1) for c in children for slot, t0, t1 in json.loads(c.data.tags[f"{T}held"])]
    for slot in {h[0] for h in held}:
        spans = sorted((t0, t1) for s, t0, t1 in held if s == slot)
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), f"{slot} was shared: {spans}"
    assert {h[0] for h in held} == {"loop-a:cpu", "loop-b:cpu"}

    parent = tracker.client.get_run(result["parent_run_id"])
    assert parent.data.metrics["gpu_seconds"] == pytest.approx(sum(c.data.metrics["gpu_seconds"] for c in children))
    assert parent.data.metrics["cost_usd"] == pytest.approx(sum(c.data.metrics["cost_usd"] for c in children))
    for s in (a, b):  # each host got the bundle under its content's name, and no half-unpacked one
        names = [p.name for p in (Path(loopback.host(s).workdir) / "bundles").iterdir()]
        assert names and all(len(n) == 16 and not n.startswith(".") for n in names), names


def test_a_hanging_candidate_is_killed_on_the_host_and_recorded_as_a_crash(loopback):
    from flows.pipeline import jobs_for
    from gpu_pool.ssh import SSHExecutor
    from harness.job import Candidate

    host = loopback.host(loopback.servers[1])
    slot = Pool(hosts=[host]).slots()[0]
    source = "def rmsnorm(x, weight, eps):\n    while True:\n        pass\n"
    job = jobs_for(Candidate(op="rmsnorm", kind="free", source=source), Target(model="tiny", dtype="fp32"), slot)
    run = SSHExecutor().run(job["compile"], slot, timeout_s=8)
    assert run.verdict.status == "crash" and run.verdict.failing_gate.name == "time_limit"
    assert 8 <= run.held_s < 20
    runs = Path(host.workdir) / "runs"
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cwd_under(p, runs)]
    assert leftovers == [], "the harness's process group outlived its time limit"


def _cwd_under(proc: Path, root: Path) -> bool:
    try:
        return str(root) in os.readlink(proc / "cwd")
    except OSError:
        return False
