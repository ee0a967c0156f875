"""The pool over real SSH: OpenSSH servers on loopback ports, each a "host" with its own host
key and workdir, reached with a generated client key. Candidates run under Triton's interpreter."""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
from loopback_sshd import free_port, loopback_hosts
from moto_s3 import CREDENTIALS, s3_server

from flows.optimize_op import optimize_op
from gpu_pool.bundle import current_bundle
from gpu_pool.health import HEALTH, HostFault
from gpu_pool.pool import Pool
from gpu_pool.ssh import connect, ensure_bundle, workdir_of
from targets import Target
from tracking.cost import run_cost
from tracking.history import search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    with loopback_hosts(tmp_path_factory.mktemp("ssh"), ("loop-a", "loop-b")) as hosts:
        yield hosts


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


BUNDLES_BUCKET = "bundles-bucket"
# what must never reach a host's files, its command lines or its environment
SECRETS = (CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"], "X-Amz-", "Signature=")


@pytest.fixture
def bundles_on_s3(tmp_path, monkeypatch):
    """moto's S3 server, named to the controller as INFERSMITH_S3_URI with its keys, as a team's is."""
    with s3_server(tmp_path / "moto.log", buckets=(BUNDLES_BUCKET,)) as s3:
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("INFERSMITH_S3_URI", f"s3://{BUNDLES_BUCKET}/team")
        yield s3


def _recording_python(tmp_path: Path, name: str, before: str = "") -> tuple[Path, Path]:
    """A host python that records each command line it is given and the environment it has, then
    runs the real one: what a person on the host could see of the fetch."""
    record = tmp_path / f"{name}.record"
    wrapper = tmp_path / name
    wrapper.write_text(f'#!/bin/sh\n{{ echo "argv: $*"; env; }} >> {record}\n{before}exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, record


def _no_secret_under(*paths: Path) -> None:
    for root in paths:
        for f in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
            text = f.read_bytes().decode(errors="replace")
            assert not [s for s in SECRETS if s in text], f"{f} holds a credential or a presigned link"


def test_a_stage_runs_from_a_bundle_the_host_fetched_from_s3(loopback, bundles_on_s3, tmp_path):
    from contract.job import Candidate
    from engine_templates.ops import OPS
    from gpu_pool.ssh import SSHExecutor
    from object_store import S3Location
    from object_store.s3 import S3Store
    from tasks.evaluate import jobs_for

    python, record = _recording_python(tmp_path, "python")
    host = loopback.host(loopback.servers[1]).model_copy(update={"workdir": str(tmp_path / "work"),
                                                                 "python": str(python)})
    slot = Pool(hosts=[host]).slots()[0]
    template = next(iter(OPS["rmsnorm"].templates.values()))
    cand = Candidate(op="rmsnorm", kind="template", template=template.name, point=dict(template.default))
    run = SSHExecutor().run(jobs_for(cand, Target(model="tiny", dtype="fp32"), slot)["compile"], slot, timeout_s=120)
    assert run.verdict.status == "pass", run.verdict

    bundle = current_bundle()
    stored = bundles_on_s3.client().get_object(Bucket=BUNDLES_BUCKET, Key=f"team/bundles/{bundle.digest}.tgz")
    assert hashlib.sha256(stored["Body"].read()).hexdigest() == bundle.sha256
    bundles = tmp_path / "work" / "bundles"
    assert [p.name for p in bundles.iterdir()] == [bundle.digest]  # nothing half-fetched left beside it
    with tarfile.open(fileobj=io.BytesIO(bundle.tarball), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        assert members and all((bundles / bundle.digest / m.name).read_bytes() == tar.extractfile(m).read()
                               for m in members)
    # the host fetched it with its own python, the link on stdin: no key, no link in what it saw
    seen = record.read_text()
    assert "urllib.request.urlopen" in seen and f" {bundle.sha256}" in seen
    assert "AWS_" not in seen and "://" not in "".join(line for line in seen.splitlines()
                                                       if line.startswith("argv:"))
    _no_secret_under(record, tmp_path / "work")
    # uploaded once per content: a second host finds it there, and it is not sent again
    assert S3Store(S3Location.parse(f"s3://{BUNDLES_BUCKET}/team")).put_once(b"other", f"bundles/{bundle.digest}.tgz") \
        is False


def test_a_bundle_on_s3_that_is_not_the_uploaded_one_is_refused(loopback, bundles_on_s3, tmp_path):
    from object_store import ObjectStoreError

    bundle = current_bundle()
    key = f"team/bundles/{bundle.digest}.tgz"
    bundles_on_s3.client().put_object(Bucket=BUNDLES_BUCKET, Key=key, Body=bundle.tarball[:-1] + b"x")
    host = loopback.host(loopback.servers[1]).model_copy(update={"workdir": str(tmp_path / "work")})
    client = connect(host)
    try:
        with pytest.raises(ObjectStoreError) as refused:
            ensure_bundle(client, host, workdir_of(client, host))
    finally:
        client.close()
    message = str(refused.value)
    assert message.startswith(f"S3: the worker bundle s3://{BUNDLES_BUCKET}/{key} is not the one uploaded "
                              "(its sha256 is ")
    assert message.endswith("refused; delete it and the next stage sends it again") and "\n" not in message
    assert list((tmp_path / "work" / "bundles").iterdir()) == []  # nothing unpacked, nothing left
    _no_secret_under(tmp_path / "work")
    assert not [s for s in SECRETS if s in message]


def test_a_host_that_cannot_fetch_the_bundle_is_a_host_fault_naming_the_bucket(loopback, bundles_on_s3, tmp_path):
    """The bucket is reachable from the controller but not from the host (here: its traffic goes
    through a proxy that is not there): the host is at fault, and the work goes elsewhere."""
    python, _ = _recording_python(tmp_path, "python", before=f"export http_proxy=http://127.0.0.1:{free_port()} "
                                                              "no_proxy=\n")
    host = loopback.host(loopback.servers[1]).model_copy(update={"workdir": str(tmp_path / "work"),
                                                                 "python": str(python)})
    client = connect(host)
    try:
        with pytest.raises(HostFault) as fault:
            ensure_bundle(client, host, workdir_of(client, host))
    finally:
        client.close()
    uri = f"s3://{BUNDLES_BUCKET}/team/bundles/{current_bundle().digest}.tgz"
    assert fault.value.reason == f"cannot fetch the worker bundle {uri}: [Errno 111] Connection refused"
    assert list((tmp_path / "work" / "bundles").iterdir()) == []


def test_a_bucket_the_controller_cannot_reach_fails_before_the_host_is_touched(loopback, bundles_on_s3, tmp_path,
                                                                                monkeypatch):
    from object_store import ObjectStoreError

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    host = loopback.host(loopback.servers[1]).model_copy(update={"workdir": str(tmp_path / "work")})
    client = connect(host)
    try:
        with pytest.raises(ObjectStoreError) as e:
            ensure_bundle(client, host, workdir_of(client, host))
    finally:
        client.close()
    assert str(e.value).startswith(f"S3 unreachable: cannot look for bundles/{current_bundle().digest}.tgz in "
                                   f"bucket {BUNDLES_BUCKET} at {endpoint}: ")
    assert not (tmp_path / "work" / "bundles").exists()


def test_pool_check_reports_each_host_and_an_unreachable_one_as_a_row(loopback, tmp_path, capsys):
    from cli.main import main

    a = loopback.servers[0]
    pool_file = tmp_path / "pool.yaml"
    hosts = [loopback.host(a).model_dump(mode="json"),
             loopback.host(a).model_copy(update={"name": "gone", "port": free_port()}).model_dump(mode="json")]
    import yaml
    pool_file.write_text(yaml.safe_dump({"hosts": hosts}))
    assert main(["pool", "check", "--pool", str(pool_file), "--stage-timeout", "120"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["host", "address", "class", "status"]
    row_a = next(line for line in out if line.startswith("loop-a"))
    row_gone = next(line for line in out if line.startswith("gone"))
    assert " ok " in row_a and "none (CPU)" in row_a and "ok (compile" in row_a
    # what the serve stage needs of the host's python, reported beside torch and triton
    from importlib.metadata import version
    assert out[0].split()[8:12] == ["transformers", "aiperf", "vllm", "sglang"]
    assert f" {version('transformers')} " in row_a and f" {version('aiperf')} " in row_a
    # and the baseline engines a target may name ("missing" where the python lacks one, as here)
    import importlib.util
    engines = slice(out[0].index("vllm"), out[0].index("bundle"))
    assert row_a[engines].split() == [version(e) if importlib.util.find_spec(e) else "missing"
                                      for e in ("vllm", "sglang")]
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

    # the flow's spend is its candidates' evaluations, the held-out shapes timed in their bench stages
    parent = tracker.client.get_run(result["parent_run_id"])
    spent = [run_cost(c.data.metrics) for c in children]
    assert any(f"{T}held_out" in c.data.tags for c in children)
    assert all(c.data.metrics.get("held_out_gpu_seconds", 0) == 0 for c in children)
    assert parent.data.metrics["gpu_seconds"] == pytest.approx(sum(c.gpu_seconds for c in spent))
    assert parent.data.metrics["cost_usd"] == pytest.approx(sum(c.gpu_usd for c in spent))
    for s in (a, b):  # each host got the bundle under its content's name, and no half-unpacked one
        names = [p.name for p in (Path(loopback.host(s).workdir) / "bundles").iterdir()]
        assert names and all(len(n) == 16 and not n.startswith(".") for n in names), names


def test_a_hanging_candidate_is_killed_on_the_host_and_recorded_as_a_crash(loopback):
    from contract.job import Candidate
    from gpu_pool.ssh import SSHExecutor
    from tasks.evaluate import jobs_for

    host = loopback.host(loopback.servers[1])
    slot = Pool(hosts=[host]).slots()[0]
    source = "def rmsnorm(x, weight, eps):\n    while True:\n        pass\n"
    job = jobs_for(Candidate(op="rmsnorm", kind="free", source=source), Target(model="tiny", dtype="fp32"), slot)
    run = SSHExecutor().run(job["compile"], slot, timeout_s=8)
    assert run.verdict.status == "crash" and run.verdict.failing_gate.name == "time_limit"
    # the harness on the host stops the candidate 2 s inside the limit and writes the verdict itself
    assert "the harness killed the candidate's process" in run.verdict.failing_gate.detail
    assert 4 <= run.held_s < 8
    runs = Path(host.workdir) / "runs"
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cwd_under(p, runs)]
    assert leftovers == [], "the harness's process group outlived its time limit"


def _cwd_under(proc: Path, root: Path) -> bool:
    try:
        return str(root) in os.readlink(proc / "cwd")
    except OSError:
        return False


def test_the_pre_run_serve_check_warns_of_an_unreachable_host_and_goes_on(loopback, tmp_path, capsys):
    """The dispatch retries a host that cannot be reached, so the check before a serve run lets the
    run go on, but says so in one line with the reason."""
    from gpu_pool.check import serve_problems

    gone = loopback.host(loopback.servers[0]).model_copy(update={"name": "gone", "port": free_port()})
    assert serve_problems(gone, str(tmp_path)) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infersmith: warning: host gone could not be checked before "
                                               "the run (cannot connect: ")
    assert err[0].endswith("the run goes on, and work sent there is retried on another host")


def test_the_pre_run_serve_check_reports_what_a_reachable_host_cannot_do(loopback, tmp_path, capsys):
    """A workdir the host cannot create, a bundle it cannot write: problems, not nothing."""
    from gpu_pool.check import serve_problems

    host = loopback.host(loopback.servers[1])  # a's sshd is killed by the sweep above
    no_workdir = host.model_copy(update={"workdir": "/proc/infersmith-work"})
    assert serve_problems(no_workdir, str(tmp_path)) == [
        "cannot create workdir /proc/infersmith-work: mkdir: cannot create directory '/proc/infersmith-work': "
        "No such file or directory"]
    blocked = tmp_path / "work"
    blocked.mkdir()
    (blocked / "bundles").write_text("a file where the bundles folder goes")
    (problem,) = serve_problems(host.model_copy(update={"workdir": str(blocked)}), str(tmp_path))
    assert problem.startswith(f"cannot create {blocked}/bundles/.") and problem.endswith("Not a directory")
    assert capsys.readouterr().err == ""


def test_a_command_past_its_limit_is_a_host_fault_not_a_lost_connection(loopback, tmp_path):
    """The command can end only once the test has made a file, which it does after run_command
    returned (or after a minute): run_command returned at its limit, not at the command's end."""
    from gpu_pool.health import HostUnreachable
    from gpu_pool.ssh import run_command

    host = loopback.host(loopback.servers[1])  # a's sshd is killed by the sweep above
    client = connect(host)
    may_end = tmp_path / "may-end"
    try:
        with pytest.raises(HostFault, match=r"`sh -c 'for i in .*` did not finish within 1 s") as fault:
            run_command(client, host, f"env A=1 sh -c 'for i in $(seq 600); do [ -e {may_end} ] && exit; sleep 0.1; done'",
                        1)
        may_end.touch()
        assert not isinstance(fault.value, HostUnreachable)
        assert run_command(client, host, "echo still here", 10) == (0, "still here\n", "")
    finally:
        client.close()


def test_a_candidates_stages_run_in_one_session_on_the_host_and_a_hang_stops_at_its_stages_limit(loopback):
    """Over SSH too, a candidate's three stages drive one supervisor and one sandbox on the host
    (gpu_pool/ssh.py's SSHSession): one sandbox process id in every stage's verdict, the next
    candidate another; a candidate that hangs in its check stage is stopped at the check stage's
    limit, and its session's directory on the host is gone after either."""
    from contract.job import Candidate
    from gpu_pool.executors import candidate_session, run_stage
    from tasks.evaluate import run_stages
    from tracking.ledger import Charge

    host = loopback.host(loopback.servers[1])
    slot = Pool(hosts=[host]).slots()[0]
    candidates = Path(__file__).resolve().parent / "session_candidates"
    seen: list[list[str]] = []

    def stage(name, job, slot, limit, session):
        run = run_stage(job, slot, limit, session)
        seen[-1].append(run.verdict.device.get("sandbox", ""))
        return run

    def evaluate(source: str, target: Target):
        seen.append([])
        return run_stages(Candidate("rmsnorm", "free", source=source, origin="test"), target, slot, stage, Charge(),
                          session=candidate_session)

    honest = (candidates / "finds_state.py").read_text()
    target = Target(model="tiny", dtype="fp32", budget={"stage_timeout_s": 120, "check_timeout_s": 10})
    first, second = evaluate(honest, target), evaluate(honest + "\n# another candidate\n", target)
    assert (first.status, second.status) == ("pass", "pass"), first.to_json()
    pids = [{entry.split(",")[0] for entry in stages} for stages in seen]
    assert [len(p) for p in pids] == [1, 1] and pids[0] != pids[1]
    assert [entry.split(", ")[1] for entry in seen[0]] == [f"stage {n} of its session" for n in (1, 2, 3)]

    hangs = (candidates / "hangs_after.py").read_text().replace("HANG_AFTER = 0", "HANG_AFTER = 5")  # compile's 5 calls
    t = time.monotonic()
    hung = evaluate(hangs, target)
    assert (hung.status, hung.failing_gate.name) == ("crash", "time_limit"), hung.to_json()
    assert hung.failing_gate.detail.startswith("check stage ran past its 10 s limit")
    assert hung.stages == ["compile", "check"] and time.monotonic() - t < 120
    assert not list((Path(host.workdir) / "runs").glob("*-session-*"))
