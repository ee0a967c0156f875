"""OpenSSH servers on loopback ports as pool hosts, each with its own host key and workdir,
reached with a generated client key: the SSH tests' hosts (tests/test_pool_ssh.py,
tests/test_serve_stage.py)."""
from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from services import missing

from gpu_pool.pool import Host

SSHD = Path("/usr/sbin/sshd")


def free_port() -> int:
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


@contextmanager
def loopback_hosts(root: Path, names: tuple[str, ...]) -> Iterator[Loopback]:
    """One running sshd per name under root; all killed on exit. Without sshd: skipped, or failed
    under CI=true (tests/services.py)."""
    if not SSHD.exists():
        missing("needs an OpenSSH server at /usr/sbin/sshd (.ci/run installs openssh-server)")
    root.mkdir(parents=True, exist_ok=True)
    client_key = root / "client_key"
    authorized = root / "authorized_keys"
    authorized.write_text(_keygen(client_key) + "\n")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    servers = []
    for name in names:
        d = root / name
        d.mkdir()
        port = free_port()
        pub = _keygen(d / "host_key")
        (d / "sshd_config").write_text("\n".join([
            f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host_key'}",
            f"AuthorizedKeysFile {authorized}", "StrictModes no", "UsePAM no", f"PidFile {d / 'sshd.pid'}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp", "LogLevel ERROR", ""]))
        servers.append(SSHServer(name, port, d, pub))
    known = root / "known_hosts"
    known.write_text("".join(f"[127.0.0.1]:{s.port} {' '.join(s.host_key_pub.split()[:2])}\n" for s in servers))
    try:
        for s in servers:
            s.start()
        yield Loopback(servers, client_key, known, root)
    finally:
        for s in servers:
            if s.proc and s.proc.poll() is None:
                s.kill()
