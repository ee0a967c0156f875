"""The serve stage on a pool host over SSH: one session (reference, baseline or candidate) runs
`python -m harness.serve run` there, where its servers (every replica, and their load balancer)
start and AIPerf loads them, and its artifacts come back here to be judged and logged
(harness/serve/remote.py is the other side).

Remote layout under the host's workdir: `bundles/<digest>/` (shared with the op stages) and
`runs/serve-<kind>-<nonce>/`, removed after the session whatever its end. The model directory is
a path on the host; checkpoints are never shipped.
"""
from __future__ import annotations

import io
import json
import logging
import random
import shlex
import stat
import time
import uuid
from pathlib import Path
from typing import Callable

import paramiko

from contract.serve import AIPerfError, EngineCandidate, PatternRun, Reference, Served, ServeJob, ServerError
from contract.verdict import FAIL, PASS, Gate, Verdict
from gpu_pool.health import HostFault, HostUnreachable
from gpu_pool.pool import Host, Slot
from gpu_pool.ssh import REMOTE_GRACE_S, connect, ensure_bundle, run_command, workdir_of, worker_env
from harness.serve import under_load
from harness.serve.remote import MARKER_VAR, completion_from_dict, exchange_names, job_to_dict, runs_from_dict
from harness.serve.server import BALANCER_START_S
from harness.serve.stage import fresh_prompts, prompt_numbers, reference_judge

POLL_S = 0.2
ACCURACY_S = 600.0  # the accuracy prompts of one server, within a session's limit
STOP_S = 60.0  # stopping one server or balancer (SIGTERM, then SIGKILL after 30 s), and the session's own start
log = logging.getLogger("infersmith.pool")
# (None before load, else the pattern; the completions as the host's file holds them): whether to go on
# (the handshake's pattern, the completions' bytes) -> (whether to go on, the prompts the host may now
# send: their numbers and token ids)
Decide = Callable[[str | None, bytes], tuple[bool, dict[int, list[int]]]]


class ServeSetupError(Exception):
    """The host cannot serve this model: its directory or aiperf is missing there. One line."""


def session_limit_s(job: ServeJob) -> float:
    """When the controller gives up on a session: a bound on every wait inside it, so that only a
    session that hangs outside them (or a host that stopped answering) reaches it."""
    replicas = len(job.devices)
    processes = replicas + (replicas > 1)  # a balancer in front of several, started after them
    return (job.start_timeout_s + (BALANCER_START_S if replicas > 1 else 0.0) + ACCURACY_S
            + len(job.patterns) * job.pattern_timeout_s + (processes + 1) * STOP_S)


class SSHSessions:
    """An end-to-end stage's sessions on a leased group of a pool host's slots (leases.lease_group):
    each one `python -m harness.serve <worker> job.json .` there, under a time limit, its accuracy
    handshakes answered meanwhile and what it wrote fetched back. SSHServe runs the text stage's;
    gpu_pool/ssh_images.py's SSHImages, the image stage's."""

    worker = "run"  # the worker's command for this stage's sessions

    def __init__(self, group: list[Slot], limit_s: float | None = None):
        self.group, self.limit_s = group, limit_s
        self.slot = group[0]  # the host, and the worker's own environment
        self.label = ",".join(s.label for s in group)

    def _wire(self, job) -> dict:
        """The job as the session's job.json carries it."""
        raise NotImplementedError

    def _stage_limit_s(self, job) -> float:
        """When the controller gives up on one of the stage's sessions, unless limit_s says."""
        raise NotImplementedError

    # -- one session ------------------------------------------------------------------
    def _limit(self, job) -> float:
        return self.limit_s if self.limit_s is not None else self._stage_limit_s(job)

    def _session(self, kind: str, job, out: Path, payload: dict,
                 handshakes: tuple[Decide, list[str | None]] | None = None,
                 secret: str | None = None) -> tuple[dict, dict | None]:
        """(result.json, or {"timed_out": s} or {"died": why}; the secret file's JSON) of one session."""
        host, q = self.slot.host, shlex.quote
        client = connect(host)
        try:
            workdir = workdir_of(client, host)
            bundle_dir, _ = ensure_bundle(client, host, workdir)
            marker = uuid.uuid4().hex
            run_dir = f"{workdir}/runs/serve-{kind}-{marker[:12]}"
            run_command(client, host, f"mkdir -p {q(run_dir)}/out {q(run_dir)}/exchange")
            spec = {"kind": kind, "job": self._wire(job), **payload}
            try:
                with client.open_sftp() as sftp:
                    sftp.putfo(io.BytesIO(json.dumps(spec).encode()), f"{run_dir}/job.json")
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise HostUnreachable(host, f"connection lost sending the serve job: {e}") from None
            env = " ".join(f"{k}={q(v)}" for k, v in worker_env(self.slot, bundle_dir).items())
            killer = f"env {env} {host.python} -m harness.serve kill {marker}"
            limit = self._limit(job)
            # The host ends the session on its own REMOTE_GRACE_S after the controller would have
            # (the controller may be gone), then kills what the worker started: the servers and
            # AIPerf run in sessions of their own, so only the marker in their environment finds them.
            inner = (f"env {env} {MARKER_VAR}={marker} timeout -s KILL {limit + REMOTE_GRACE_S:.0f} "
                     f"{host.python} -m harness.serve {self.worker} job.json . >out/worker.log 2>&1; rc=$?; {killer}; "
                     "exit $rc")
            try:
                ended = self._wait(client, f"cd {q(run_dir)} && exec setsid -w sh -c {q(inner)}", run_dir,
                                   limit, handshakes)
            except BaseException:  # the connection dropped, the flow was cancelled, Ctrl-C
                self._salvage(client, run_dir, out, killer)
                raise
            # after a timeout the servers die first; either way what the session wrote comes back
            result, hidden = _wrap_up(client, host, run_dir, out, secret, killer=None if ended else killer)
        finally:
            client.close()
        if not ended:
            return {"timed_out": limit}, None
        return result if result is not None else {"died": tail_of(out / "worker.log", 600)}, hidden

    def _salvage(self, client: paramiko.SSHClient, run_dir: str, out: Path, killer: str) -> None:
        """Stop a session the controller gives up on and keep what it wrote, over the same connection
        if it still stands, else a fresh one. What fails here is logged: the host ends the session
        on its own anyway, and the fault that led here is the one raised."""
        fresh = None
        try:
            transport = client.get_transport()
            if transport is None or not transport.is_active():
                client = fresh = connect(self.slot.host)
            _wrap_up(client, self.slot.host, run_dir, out, None, killer)
        except HostFault as fault:
            log.warning("%s: could not stop the serve session %s (the host ends it within %.0f s of its "
                        "limit): %s", self.label, run_dir, REMOTE_GRACE_S, fault.reason)
        finally:
            if fresh is not None:
                fresh.close()

    def _wait(self, client: paramiko.SSHClient, command: str, run_dir: str, limit_s: float,
              handshakes: tuple[Decide, list[str | None]] | None) -> bool:
        """True when the session ended on its own, False when it ran past limit_s; a HostFault
        when the connection went. Meanwhile answers the accuracy handshakes, if any, in their order."""
        decide, rounds = handshakes if handshakes is not None else (None, [])
        rounds = list(rounds)  # the handshakes still to answer, in the order the host asks them
        host = self.slot.host
        transport = client.get_transport()
        deadline = time.monotonic() + limit_s
        try:
            chan = transport.open_session()
            chan.exec_command(command)
            sftp = client.open_sftp()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(host, f"connection lost starting the serve session: {e}") from None
        try:
            while not chan.exit_status_ready():
                if not transport.is_active():
                    break
                if time.monotonic() > deadline:
                    return False
                if rounds and _answer(sftp, run_dir, rounds[0], decide):
                    rounds.pop(0)
                chan.status_event.wait(POLL_S)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(host, f"connection lost during the serve session: {e}") from None
        finally:
            sftp.close()
        if not chan.exit_status_ready() or chan.recv_exit_status() == -1:
            raise HostUnreachable(host, "connection dropped while the serve session ran")
        return True


class SSHServe(SSHSessions):
    """The text stage's sessions: one session runs every replica, each on its GPU of the group as
    job.devices says."""

    def _wire(self, job: ServeJob) -> dict:
        return job_to_dict(job)

    def _stage_limit_s(self, job: ServeJob) -> float:
        return session_limit_s(job)

    def reference(self, job: ServeJob, out: Path, rng: random.Random) -> tuple[Reference, dict | None]:
        """The reference's answers (the held-out prompts drawn there from rng's seed, which, like
        the answers, leaves the host with this session) and the baseline's runs when it is the baseline."""
        result, answers = self._session("reference", job, out, {"seed": rng.getrandbits(64)}, secret="answers.json")
        raise_error(result, self.slot.host, self.label, "reference")
        if answers is None:
            raise ServerError(f"the reference session on {self.label} ended without its answers")
        reference = Reference(answers["prompts"], [completion_from_dict(c) for c in answers["completions"]])
        return reference, None if result["runs"] is None else runs_from_dict(result["runs"], out)

    def baseline(self, job: ServeJob, out: Path) -> dict[str, PatternRun]:
        result, _ = self._session("baseline", job, out, {})
        raise_error(result, self.slot.host, self.label, "baseline")
        return runs_from_dict(result["runs"], out)

    def candidate(self, job: ServeJob, cand: EngineCandidate, reference: Reference, out: Path,
                  command: str | None = None) -> Served:
        judged: dict[str | None, tuple[bool, str, dict]] = {}
        judge = reference_judge(reference, job.accuracy)

        rounds = [None] + ([p.name for p in job.patterns] if job.accuracy.under_load else [])
        before = len(reference.prompts) - fresh_prompts(job)

        def decide(pattern: str | None, raw: bytes) -> tuple[bool, dict[int, list[int]]]:
            """Whether to go on, and with it the next pattern's fresh prompt: the host holds none
            before the round it is asked in (the candidate's servers could read it there)."""
            if not judged_ok(pattern, raw):
                return False, {}
            following = rounds.index(pattern) + 1
            if following == len(rounds):
                return True, {}
            n = prompt_numbers(job, len(reference.prompts), rounds[following])[-1]  # its fresh one, last
            return True, {n: reference.prompts[n]}

        def judged_ok(pattern: str | None, raw: bytes) -> bool:
            """The completions, every replica's before load (pattern None) or the balancer's under a
            pattern's load, judged here against the answers only this side holds, on the prompts
            this side knows were asked. Anything on the host may have written the file (the
            candidate's servers run as the same user): what does not parse, or answers for other
            than every replica (one list under load), fails."""
            try:
                answers = [[completion_from_dict(c) for c in got] for got in json.loads(raw)]
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                judged[pattern] = (False, f"the completions from {self.label} do not parse ({type(e).__name__}: "
                                          f"{str(e)[:200]})", {})
                return False
            expected = len(job.devices) if pattern is None else 1
            if len(answers) != expected:
                judged[pattern] = (False, f"answers from {len(answers)} replicas, {len(job.devices)} were started"
                                   if pattern is None else f"{len(answers)} lists of answers, 1 expected", {})
                return False
            judged[pattern] = judge(pattern, prompt_numbers(job, len(reference.prompts), pattern), answers)
            return judged[pattern][0]

        sources = {op: Path(c["path"]).read_text() for op, c in cand.kernels.items() if c.get("impl") == "free"}
        t0 = time.monotonic()
        shown = reference.prompts[:before] + [None] * (len(reference.prompts) - before)  # the fresh: later
        result, _ = self._session("candidate", job, out, {"candidate": cand.to_dict(), "command": command,
                                                          "prompts": shown, "sources": sources},
                                  (decide, rounds))
        if "verdict" not in result:
            raise_error(result, self.slot.host, self.label, "candidate", verdict_instead=True)
            verdict = Verdict(op="engine", candidate_id=cand.id, stages=["serve"], log_tail=tail_of(out / "worker.log"))
            verdict.crash("serve_session", f"the serve session on {self.label} {how_it_ended(result)}; what it left "
                                           "is kept (worker.log and the servers' logs)")
            verdict.wall_s = time.monotonic() - t0
            return Served(verdict)
        served = Served(Verdict.from_dict(result["verdict"]), runs_from_dict(result["runs"], out), result["metrics"])
        served.verdict.candidate_id = cand.id
        own_accuracy(served, judged, tuple(p.name for p in job.patterns) if job.accuracy.under_load else ())
        return served

def _answer(sftp: paramiko.SFTPClient, run_dir: str, pattern: str | None, decide: Decide) -> bool:
    """Judges the candidate's completions of one handshake once they are there; whether it did."""
    completions, decision = exchange_names(pattern)
    try:
        with sftp.open(f"{run_dir}/exchange/{completions}") as f:
            raw = f.read()
    except FileNotFoundError:
        return False
    go_on, prompts = decide(pattern, raw)
    body = json.dumps({"load": go_on, "prompts": {str(n): ids for n, ids in prompts.items()}}).encode()
    sftp.putfo(io.BytesIO(body), f"{run_dir}/exchange/.decision.tmp")
    sftp.posix_rename(f"{run_dir}/exchange/.decision.tmp", f"{run_dir}/exchange/{decision}")
    return True


def _wrap_up(client: paramiko.SSHClient, host: Host, run_dir: str, out: Path, secret: str | None,
             killer: str | None) -> tuple[dict | None, dict | None]:
    """The session's end on the host: its processes killed (when `killer` is given), out/ copied
    into `out`, result.json and the secret file read into memory only, the run folder removed."""
    if killer:
        run_command(client, host, killer, 30)
    found = _collect(client, host, run_dir, out, secret)
    run_command(client, host, f"rm -rf {shlex.quote(run_dir)}")
    return found


def _collect(client: paramiko.SSHClient, host: Host, run_dir: str, out: Path,
             secret: str | None) -> tuple[dict | None, dict | None]:
    def fetch(remote: str, local: Path) -> None:
        local.mkdir(parents=True, exist_ok=True)
        for entry in sftp.listdir_attr(remote):
            if stat.S_ISDIR(entry.st_mode):
                fetch(f"{remote}/{entry.filename}", local / entry.filename)
            elif stat.S_ISREG(entry.st_mode):  # a link a candidate planted is not followed
                sftp.get(f"{remote}/{entry.filename}", str(local / entry.filename))

    def read(name: str) -> dict | None:
        try:
            with sftp.open(f"{run_dir}/{name}") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    try:
        with client.open_sftp() as sftp:
            fetch(f"{run_dir}/out", out)
            return read("result.json"), (read(secret) if secret else None)
    except (paramiko.SSHException, OSError, EOFError) as e:
        raise HostUnreachable(host, f"connection lost fetching the serve session's results: {e}") from None


def how_it_ended(result: dict) -> str:
    if "timed_out" in result:
        return f"ran past its {result['timed_out']:g} s limit and was killed"
    lines = result.get("died", "").strip().splitlines()
    return f"died without a result; last log line: {lines[-1] if lines else '(none)'}"


def raise_error(result: dict, host: Host, label: str, kind: str, verdict_instead: bool = False) -> None:
    """The session's failure as the error the same failure raises on this machine. A candidate
    session that hung or died is the candidate's crash (verdict_instead); a missing model or aiperf
    is the run's error whoever runs."""
    if "setup_error" in result:
        raise ServeSetupError(f"host {host.name}: {result['setup_error']}")
    if "error" in result:
        raise {"AIPerfError": AIPerfError}.get(result["error"]["type"], ServerError)(
            f"on {label}: {result['error']['message']}")
    if ("timed_out" in result or "died" in result) and not verdict_instead:
        raise ServerError(f"the {kind} session on {label} {how_it_ended(result)}")


def own_accuracy(served: Served, judged: dict[str | None, tuple[bool, str, dict]],
                  under_load_patterns: tuple[str, ...]) -> None:
    """The accuracy gates (before load, and under the load of each of under_load_patterns) as the
    controller judged them: the host only learnt whether to go on, and anything on the host could
    have written that answer, so the host's gates are not taken on trust. A pattern loaded without
    its gate fails."""
    verdict, metrics = served.verdict, served.metrics
    gates = [g for g in verdict.gates if g.name == "accuracy"]
    if not gates:
        if verdict.status == PASS:
            verdict.crash("protocol", "the session passed without the candidate's completions being judged")
        return
    rounds = [(None, gates[0])]
    for name in under_load_patterns:
        gate = next((g for g in gates[1:] if g.detail.startswith(under_load.prefix(name))), None)
        if gate is None and name in served.runs:
            gate = Gate("accuracy", True, "")  # judged below as what the controller never saw
            verdict.gates.append(gate)
            gates.append(gate)
        if gate is not None:
            rounds.append((name, gate))
    for pattern, gate in rounds:
        got = judged.get(pattern)
        if got is None:
            if gate.passed:
                never = "the candidate's completions never reached the controller"
                gate.passed, gate.detail = False, never if pattern is None else under_load.detail(pattern, never,
                                                                                                  metrics)
        elif not got[0] or gate.passed:  # else the host gave up waiting for the decision: its gate says so
            gate.passed = got[0]
            if pattern is None:
                gate.detail = got[1]
                metrics.update(got[2])
            else:
                metrics.update(under_load.renamed(pattern, got[2]))
                gate.detail = under_load.detail(pattern, got[1], metrics)
    if any(not g.passed for g in gates) and verdict.status == PASS:
        verdict.status = FAIL


def tail_of(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
