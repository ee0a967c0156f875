"""Run one stage on a pool host over SSH: ship the bundle, run the harness, fetch the verdict.

Remote layout under the host's workdir: `bundles/<digest>/` (harness/ and engine_templates/,
unpacked once per digest) and `runs/<candidate>-<stage>-<nonce>/` (job.json, verdict.json,
logs, and the stage's session id, removed after the stage), or, for a candidate's session of
stages (`SSHSession`), `runs/<candidate>-session-<nonce>/` (session.json, logs, the session id,
removed when it ends).

The bundle travels over SFTP, or, when INFERSMITH_S3_URI names a bucket, through it: uploaded
once per content under `bundles/<digest>.tgz`, and fetched by the host with a presigned link
that its own Python reads from stdin, so that no credential, and no link, reaches the host's
files, its process list or a log.
"""
from __future__ import annotations

import getpass
import io
import json
import shlex
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from contract.job import Job
from contract.verdict import PASS
from gpu_pool.bundle import Bundle, current_bundle
from gpu_pool.health import HostFault, HostUnreachable
from gpu_pool.local import StageRun, session_key, signed_reply, verdict_from
from gpu_pool.pool import Host, Slot
from object_store import ObjectStoreError, store_from_env

if TYPE_CHECKING:
    from object_store.s3 import S3Store

# The host kills the stage itself this long after the controller's limit, in case the
# controller died and could not.
REMOTE_GRACE_S = 30.0
POLL_S = 0.1
BUNDLE_LINK_S = 600  # how long a host's presigned link to the bundle on S3 lasts
FETCH_S = 300.0  # how long a host may take to fetch it

# Run by the host's Python, standard library only: the presigned link on stdin (never in argv), the
# tarball to argv[1], refused unless its sha256 is argv[2]. Reasons never quote the link.
FETCH = r"""
import hashlib, http.client, os, sys, urllib.error, urllib.request
path, want = sys.argv[1], sys.argv[2]
def fail(reason, code=1):
    if os.path.exists(path):
        os.remove(path)
    print(reason, file=sys.stderr)
    sys.exit(code)
digest = hashlib.sha256()
try:
    with urllib.request.urlopen(sys.stdin.readline().strip(), timeout=60) as r, open(path, "wb") as f:
        for chunk in iter(lambda: r.read(1 << 20), b""):
            digest.update(chunk)
            f.write(chunk)
except urllib.error.HTTPError as e:
    fail(f"HTTP {e.code} {e.reason}")
except urllib.error.URLError as e:
    fail(str(e.reason))
except OSError as e:
    fail(f"{type(e).__name__}: {e.strerror or e}")
except (http.client.HTTPException, ValueError) as e:
    fail(type(e).__name__)
if digest.hexdigest() != want:
    fail(f"its sha256 is {digest.hexdigest()}", 3)
"""
DIGEST_MISMATCH = 3


def connect(host: Host) -> paramiko.SSHClient:
    """An authenticated connection whose host key known_hosts vouches for, or a HostFault."""
    client = paramiko.SSHClient()
    known = host.known_hosts or Path("~/.ssh/known_hosts").expanduser()
    if known.exists():
        client.load_host_keys(str(known))  # trusting a new key records it in this file
    elif host.trust_unknown_host_key:
        known.parent.mkdir(parents=True, exist_ok=True)
        known.touch(mode=0o600)
        client.load_host_keys(str(known))
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if host.trust_unknown_host_key
                                       else paramiko.RejectPolicy())
    key = str(host.key_file) if host.key_file else None
    try:
        client.connect(host.address, port=host.port, username=host.user or getpass.getuser(),
                       key_filename=key, allow_agent=key is None, look_for_keys=key is None,
                       timeout=host.connect_timeout_s, banner_timeout=host.connect_timeout_s,
                       auth_timeout=host.connect_timeout_s)
    except paramiko.BadHostKeyException:
        client.close()
        raise HostUnreachable(host, f"host key does not match {known}: refused (possible impersonation)") from None
    except paramiko.AuthenticationException:
        client.close()
        raise HostUnreachable(host, "authentication failed") from None
    except paramiko.SSHException as e:
        client.close()
        if "not found in known_hosts" in str(e):
            raise HostUnreachable(host, f"host key unknown to {known}: refused "
                                  "(add it with ssh-keyscan, or set trust_unknown_host_key)") from None
        raise HostUnreachable(host, f"SSH error: {e}") from None
    except (OSError, EOFError) as e:  # refused, unreachable, timed out, reset
        client.close()
        raise HostUnreachable(host, f"cannot connect: {getattr(e, 'strerror', None) or e}") from None
    client.get_transport().set_keepalive(5)
    return client


def run_command(client: paramiko.SSHClient, host: Host, command: str, timeout_s: float = 60.0,
                stdin: str | None = None) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of a short command, `stdin` its input; HostUnreachable if the
    connection drops, a HostFault if the command runs past timeout_s (the channel is closed; it may
    run on there)."""
    try:
        into, out, err = client.exec_command(command, timeout=timeout_s)
        if stdin is not None:
            into.write(stdin)
            into.channel.shutdown_write()
        if not out.channel.status_event.wait(timeout_s):
            out.channel.close()
            raise HostFault(host, f"`{_short(command)}` did not finish within {timeout_s:g} s")
        rc = out.channel.recv_exit_status()
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    except socket.timeout:
        raise HostFault(host, f"`{_short(command)}` sent no output within {timeout_s:g} s") from None
    except (paramiko.SSHException, OSError, EOFError) as e:
        raise HostUnreachable(host, f"connection lost running a command: {e}") from None
    if rc == -1:
        raise HostUnreachable(host, "connection lost running a command")
    return rc, stdout, stderr


def _short(command: str) -> str:
    """The command without its environment assignments, cut to a readable length."""
    words = command.split()
    while words and (words[0] == "env" or "=" in words[0]):
        words.pop(0)
    text = " ".join(words)
    return text if len(text) <= 80 else text[:79] + "…"


def workdir_of(client: paramiko.SSHClient, host: Host) -> str:
    """The host's workdir as an absolute path, created if missing."""
    wd = host.workdir
    shell_wd = '"$HOME"/' + shlex.quote(wd[2:]) if wd.startswith("~/") else shlex.quote(wd)
    rc, out, err = run_command(client, host, f"mkdir -p {shell_wd} && cd {shell_wd} && pwd")
    if rc != 0:
        raise HostFault(host, f"cannot create workdir {wd}: {err.strip()}")
    return out.strip()


def ensure_bundle(client: paramiko.SSHClient, host: Host, workdir: str) -> tuple[str, bool]:
    """The remote bundle directory for the current sources, and whether it had to be sent."""
    bundle = current_bundle()
    target = f"{workdir}/bundles/{bundle.digest}"
    if run_command(client, host, f"test -d {shlex.quote(target)}")[0] == 0:
        return target, False
    store = store_from_env()
    on_s3 = _uploaded(store, bundle) if store is not None else None
    nonce = uuid.uuid4().hex[:8]
    tmp_tar, tmp_dir = f"{workdir}/bundles/.{bundle.digest}-{nonce}.tgz", f"{workdir}/bundles/.{bundle.digest}-{nonce}"
    rc, _, err = run_command(client, host, f"mkdir -p {shlex.quote(tmp_dir)}")
    if rc != 0:
        raise HostFault(host, f"cannot create {tmp_dir} for the worker bundle: {err.strip()}")
    if on_s3 is None:
        _send(client, host, bundle, tmp_tar)
    else:
        _fetch(client, host, bundle, *on_s3, tmp_tar, tmp_dir)
    # Unpacked beside, then renamed into place: a concurrent sender or a reader never sees half a bundle.
    q = shlex.quote
    rc, _, err = run_command(client, host, f"tar xzf {q(tmp_tar)} -C {q(tmp_dir)} && rm -f {q(tmp_tar)} && "
                                           f"(mv -T {q(tmp_dir)} {q(target)} 2>/dev/null || rm -rf {q(tmp_dir)}) "
                                           f"&& test -d {q(target)}")
    if rc != 0:
        raise HostFault(host, f"cannot unpack the worker bundle: {err.strip()}")
    return target, True


def _send(client: paramiko.SSHClient, host: Host, bundle: Bundle, tmp_tar: str) -> None:
    try:
        with client.open_sftp() as sftp:
            sftp.putfo(io.BytesIO(bundle.tarball), tmp_tar)
    except (paramiko.SSHException, OSError, EOFError) as e:
        if not client.get_transport().is_active():
            raise HostUnreachable(host, f"connection lost sending the worker bundle: {e}") from None
        raise HostFault(host, f"cannot write the worker bundle to {tmp_tar}: {e}") from None


def _uploaded(store: S3Store, bundle: Bundle) -> tuple[str, str]:
    """The bundle's S3 URI and a presigned link to it, uploaded unless there already. A bucket out of
    the controller's reach is an ObjectStoreError that fails the run: no host is to blame."""
    name = f"bundles/{bundle.digest}.tgz"
    store.put_once(bundle.tarball, name)
    return store.location.uri(name), store.presigned_get(name, BUNDLE_LINK_S)


def _fetch(client: paramiko.SSHClient, host: Host, bundle: Bundle, uri: str, link: str, tmp_tar: str,
           tmp_dir: str) -> None:
    """The host fetches the bundle to tmp_tar; tmp_dir is removed if it cannot. Unable to, the host is
    at fault; an object that is not the bundle is an ObjectStoreError (every host would refuse it)."""
    q = shlex.quote
    command = (f"{host.python} -c {q(FETCH)} {q(tmp_tar)} {bundle.sha256} "
               f"|| {{ rc=$?; rmdir {q(tmp_dir)}; exit $rc; }}")
    rc, _, err = run_command(client, host, command, FETCH_S, stdin=link + "\n")
    reason = (err.strip().splitlines() or [f"exit code {rc}"])[-1]
    if rc == DIGEST_MISMATCH:
        raise ObjectStoreError(f"S3: the worker bundle {uri} is not the one uploaded ({reason}, not "
                               f"{bundle.sha256}): refused; delete it and the next stage sends it again")
    if rc != 0:
        raise HostFault(host, f"cannot fetch the worker bundle {uri}: {reason}")


def worker_env(slot: Slot, bundle_dir: str) -> dict[str, str]:
    env = {"PYTHONPATH": bundle_dir, "PYTHONUNBUFFERED": "1"}
    if slot.gpu is None:  # a CPU-only host: Triton's interpreter, like the local executor
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu)
    return env


class SSHExecutor:
    """Each stage is a fresh `python -m harness` process group on the host, under a time limit; or
    a candidate's stages share one (`session`)."""

    def session(self, slot: Slot, jobs: dict[str, Job], limits: dict[str, float]) -> SSHSession:
        return SSHSession(slot, jobs, limits)

    def run(self, job: Job, slot: Slot, timeout_s: float) -> StageRun:
        host = slot.host
        client = connect(host)
        try:
            workdir = workdir_of(client, host)
            bundle_dir, _ = ensure_bundle(client, host, workdir)
            scratch = f"{workdir}/runs/{job.candidate.id}-{job.stage}-{uuid.uuid4().hex[:8]}"
            run_command(client, host, f"mkdir -p {shlex.quote(scratch)}")
            with client.open_sftp() as sftp:
                sftp.putfo(io.BytesIO(job.limited(timeout_s).to_json().encode()), f"{scratch}/job.json")
            t0 = time.monotonic()
            rc = self._run_harness(client, slot, scratch, bundle_dir, timeout_s)
            held = time.monotonic() - t0
            verdict_json, log = self._fetch(client, host, scratch, rc)
        finally:
            client.close()
        return StageRun(verdict_from(job, verdict_json, rc, timeout_s, log), slot, held)

    def _run_harness(self, client: paramiko.SSHClient, slot: Slot, scratch: str, bundle_dir: str,
                     timeout_s: float) -> int | None:
        host, q = slot.host, shlex.quote
        env = " ".join(f"{k}={q(v)}" for k, v in worker_env(slot, bundle_dir).items())
        inner = (f"echo $$ > sid; env {env} timeout -s KILL {timeout_s + REMOTE_GRACE_S:.0f} "
                 f"{host.python} -m harness job.json --out verdict.json >stdout.log 2>stderr.log; exit $?")
        # setsid forks when its caller leads a process group (an SSH session shell does): -w waits.
        command = f"cd {q(scratch)} && exec setsid -w sh -c {q(inner)}"
        transport = client.get_transport()
        deadline = time.monotonic() + timeout_s
        try:
            chan = transport.open_session()
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(host, f"connection lost starting the harness: {e}") from None
        finished = False
        try:
            while not chan.exit_status_ready():
                if not transport.is_active():
                    break
                if time.monotonic() > deadline:
                    return None
                chan.status_event.wait(POLL_S)
            rc = chan.recv_exit_status() if chan.exit_status_ready() else -1
            if rc == -1:  # the channel closed with no exit status: the connection, not the process
                raise HostUnreachable(host, "connection dropped while the harness ran")
            finished = True
            return -(rc - 128) if rc > 128 else rc  # the shell's 128+N: killed by signal N
        finally:  # a timeout, a cancelled flow, Ctrl-C: never leave the remote group running
            if not finished and transport.is_active():
                # The whole session: timeout(1) moves itself and the harness into a group of their own.
                run_command(client, host, f"pkill -KILL -s $(cat {q(scratch)}/sid) 2>/dev/null; true", 15)

    @staticmethod
    def _fetch(client: paramiko.SSHClient, host: Host, scratch: str, rc: int | None) -> tuple[str | None, str]:
        """The verdict (when the harness ended on its own and wrote one) and the log's tail."""
        def read(name: str) -> str | None:
            try:
                with sftp.open(f"{scratch}/{name}") as f:
                    return f.read().decode(errors="replace")
            except FileNotFoundError:
                return None
        try:
            with client.open_sftp() as sftp:
                verdict = read("verdict.json") if rc == 0 else None  # as the local executor reads it
                log = (read("stderr.log") or "")[-4000:]
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(host, f"connection lost fetching the verdict: {e}") from None
        run_command(client, host, f"rm -rf {shlex.quote(scratch)}")
        return verdict, log


class SSHSession:
    """One candidate's stages in one `python -m harness session` on the slot's host
    (harness/__main__.py), over one SSH connection: started at the first stage, asked for each
    stage in turn on the connection's stdin, its verdicts read from the connection's stdout, which
    the supervisor moves to descriptors the sandbox never inherits (its own stdout goes to a log),
    and believed only as signed with the key the supervisor read before its sandbox existed: the
    shell and timeout(1) above the supervisor hold the connection too, and are not private.
    It ends after the last stage or the first that does not pass; `close` ends it in any case, and
    removes its directory on the host. A connection that drops is a HostUnreachable."""

    def __init__(self, slot: Slot, jobs: dict[str, Job], limits: dict[str, float]):
        self.slot, self.limits = slot, limits
        self.jobs = {stage: job.limited(limits[stage]) for stage, job in jobs.items()}
        self.client: paramiko.SSHClient | None = None
        self.chan: paramiko.Channel | None = None
        self.scratch = ""
        self._replies = b""
        self.key = session_key()
        self.ended = False

    def _start(self) -> None:
        host, q = self.slot.host, shlex.quote
        self.client = connect(host)
        workdir = workdir_of(self.client, host)
        bundle_dir, _ = ensure_bundle(self.client, host, workdir)
        candidate = next(iter(self.jobs.values())).candidate
        self.scratch = f"{workdir}/runs/{candidate.id}-session-{uuid.uuid4().hex[:8]}"
        run_command(self.client, host, f"mkdir -p {q(self.scratch)}")
        spec = json.dumps({"jobs": {s: j.to_json() for s, j in self.jobs.items()}})
        try:
            with self.client.open_sftp() as sftp:
                sftp.putfo(io.BytesIO(spec.encode()), f"{self.scratch}/session.json")
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(host, f"connection lost sending the session's jobs: {e}") from None
        env = " ".join(f"{k}={q(v)}" for k, v in worker_env(self.slot, bundle_dir).items())
        total = sum(self.limits.values()) + self.limits.get("bench", 0.0) + REMOTE_GRACE_S
        # The connection's stdin and stdout become the supervisor's descriptors 3 and 4; its own
        # stdin, stdout and stderr (the sandbox's too) are /dev/null and the logs.
        inner = (f"echo $$ > sid; env {env} timeout -s KILL {total:.0f} {host.python} -m harness session "
                 f"session.json --requests 3 --replies 4 3<&0 4>&1 </dev/null >stdout.log 2>stderr.log; exit $?")
        try:
            self.chan = self.client.get_transport().open_session()
            self.chan.exec_command(f"cd {q(self.scratch)} && exec setsid -w sh -c {q(inner)}")
            self.chan.sendall((json.dumps({"key": self.key.hex()}) + "\n").encode())
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(host, f"connection lost starting the harness: {e}") from None

    def __enter__(self) -> SSHSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, job: Job, slot: Slot, timeout_s: float) -> StageRun:
        """The stage's verdict, from the session's supervisor; a crash when it does not come in
        time (the session is then killed) or the supervisor ended without it."""
        t0 = time.monotonic()
        first = self.client is None
        job = job.limited(timeout_s)
        if self.jobs.get(job.stage) != job:
            raise ValueError(f"the {job.stage} job is not the one this session was opened with")
        text, rc, log = None, -1, ""
        if not self.ended:
            if first:
                self._start()
            bench_first = first and "bench" in self.jobs and job.stage != "bench"
            text, rc = self._ask(job.stage, timeout_s + (self.limits["bench"] if bench_first else 0.0))
            log = self._log_tail()
        held = time.monotonic() - t0
        verdict = verdict_from(job, text, rc, timeout_s, log)
        if text is not None and (verdict.stages != [job.stage] or verdict.candidate_id != job.candidate.id):
            verdict = verdict_from(job, None, 1, timeout_s, f"the session replied for {verdict.stages} of "
                                                            f"{verdict.candidate_id!r}")
        verdict.phases[f"{job.stage}/start"] = max(0.0, held - verdict.wall_s) if text else 0.0
        if text is None or verdict.status != PASS:
            self.close()
        return StageRun(verdict, slot, held)

    def _ask(self, stage: str, wait_s: float) -> tuple[str | None, int | None]:
        host = self.slot.host
        try:
            self.chan.sendall((json.dumps({"stage": stage}) + "\n").encode())
        except (paramiko.SSHException, OSError, EOFError) as e:
            if not self.client.get_transport().is_active():
                raise HostUnreachable(host, f"connection lost asking for the {stage} stage: {e}") from None
            return None, self._ended_code()
        deadline = time.monotonic() + wait_s
        while b"\n" not in self._replies:
            if not self.client.get_transport().is_active():
                raise HostUnreachable(host, "connection dropped while the harness ran")
            if time.monotonic() > deadline:
                self._kill()
                return None, None
            if self.chan.recv_ready():
                chunk = self.chan.recv(1 << 16)
                if not chunk:
                    return None, self._ended_code()
                self._replies += chunk
            elif self.chan.exit_status_ready() and not self.chan.recv_ready():
                return None, self._ended_code()
            else:
                time.sleep(POLL_S / 10)
        line, self._replies = self._replies.split(b"\n", 1)
        text = signed_reply(self.key, line)
        if text is None:  # not the supervisor's: the shell and timeout(1) above it hold the connection too
            self._kill()
            return None, 1
        return text, 0

    def _ended_code(self) -> int:
        self.ended = True
        if not self.chan.status_event.wait(30):
            self._kill()
            return -9
        rc = self.chan.recv_exit_status()
        return -(rc - 128) if rc > 128 else rc

    def _kill(self) -> None:
        """The whole remote session: timeout(1) moves itself and the harness into a group of their own."""
        self.ended = True
        if self.client is not None and self.client.get_transport() and self.client.get_transport().is_active():
            run_command(self.client, self.slot.host,
                        f"pkill -KILL -s $(cat {shlex.quote(self.scratch)}/sid) 2>/dev/null; true", 15)

    def _log_tail(self) -> str:
        try:
            with self.client.open_sftp() as sftp, sftp.open(f"{self.scratch}/stderr.log") as f:
                return f.read().decode(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(self.slot.host, f"connection lost fetching the log: {e}") from None

    def close(self) -> None:
        """End the session (its supervisor ends its sandbox first), and remove its directory."""
        if self.client is None:
            self.ended = True
            return
        try:
            if self.chan is not None and not self.chan.closed:
                self.chan.shutdown_write()  # the requests end: the supervisor ends the session
                if not self.chan.status_event.wait(30):
                    self._kill()
            self._kill()  # whatever the candidate left in the remote session
            run_command(self.client, self.slot.host, f"rm -rf {shlex.quote(self.scratch)}")
        except HostFault:
            pass  # the host is gone or stuck: its fault is the stage's to report, not the cleanup's
        except (paramiko.SSHException, OSError, EOFError):
            pass  # the connection dropped: the host kills the session itself (`timeout`)
        finally:
            self.client.close()
            self.client, self.chan, self.ended = None, None, True
