"""pool.yaml validation, leases on Prefect's test server, and re-queueing a killed flow's candidates."""
from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from contract.job import Candidate
from flows.optimize_op import optimize_op, scope_for
from gpu_pool.leases import ensure_limits, free_slots, lease_group, try_lease
from gpu_pool.pool import Host, Pool, local_pool
from gpu_pool.pool_file import PoolFileError, load_pool
from targets import Target
from tracking.history import search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

GOOD = """
hosts:
  - name: h100-a
    address: 10.0.0.5
    user: ubuntu
    key_file: keys/id_ed25519
    gpus: [0, 1]
    gpu_class: h100
    usd_per_gpu_hour: 2.5
    python: /opt/venv/bin/python
"""


def test_a_good_pool_file_gives_one_slot_per_gpu_and_resolves_the_key_path(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_text(GOOD)
    pool = load_pool(f)
    assert [s.label for s in pool.slots()] == ["h100-a:gpu0", "h100-a:gpu1"]
    assert [s.lease_name for s in pool.slots("h100")] == ["infersmith-gpu-h100-a-0", "infersmith-gpu-h100-a-1"]
    assert pool.slots("b200") == []
    assert pool.hosts[0].key_file == tmp_path / "keys" / "id_ed25519"
    assert pool.slots()[0].usd_per_second == pytest.approx(2.5 / 3600)


@pytest.mark.parametrize("text, message", [
    (GOOD.replace("gpus: [0, 1]", "gpus: [0, 0]"), "hosts[0] (h100-a).gpus: GPU indices repeat: [0, 0]"),
    (GOOD + "    port: 99999\n", "hosts[0] (h100-a).port: Input should be less than or equal to 65535"),
    (GOOD + "    colour: red\n", "hosts[0] (h100-a).colour: Extra inputs are not permitted"),
    (GOOD.replace("gpu_class: h100", "gpu_class: cpu"), "hosts[0] (h100-a): lists GPUs but gpu_class is cpu"),
    (GOOD + GOOD.replace("hosts:", ""), "hosts: host names must be unique: h100-a repeats"),
    ("hosts: [", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_a_bad_pool_file_is_one_line_naming_the_field(tmp_path, text, message):
    f = tmp_path / "pool.yaml"
    f.write_text(text)
    with pytest.raises(PoolFileError) as e:
        load_pool(f)
    assert message in str(e.value) and str(f) in str(e.value) and "\n" not in str(e.value)


def test_a_pool_file_that_is_not_text_is_one_line(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(PoolFileError, match=r"pool.yaml: not a text file \(not UTF-8\)$"):
        load_pool(f)


def test_the_cli_reports_a_bad_pool_file_as_a_usage_error(tmp_path, capsys):
    from cli.main import main

    f = tmp_path / "pool.yaml"
    f.write_text(GOOD + "    port: 0\n")
    assert main(["pool", "check", "--pool", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("infersmith: bad pool file:") and "port" in err and "\n" not in err


def test_a_gpu_lease_is_held_by_one_holder_at_a_time(prefect_server):
    slot = Pool(hosts=[Host(name="lease-test")]).slots()[0]
    ensure_limits(Pool(hosts=[slot.host]))
    seen = []
    with try_lease(slot) as first:
        def other():
            with try_lease(slot) as held:
                seen.append(held)
        t = threading.Thread(target=other)
        t.start()
        t.join()
    with try_lease(slot) as again:
        seen.append(again)
    assert first and seen == [False, True]


def test_a_refused_lease_is_no_error_in_the_log_and_other_failures_still_are(prefect_server):
    import logging
    from concurrent.futures import Future

    from prefect.exceptions import PrefectHTTPStatusError

    from gpu_pool.leases import ACQUIRING_SERVICE

    # Prefect's acquisition service logs every failed try as an error; a slot another holds (423)
    # is what try_lease expects when two candidates start at once, and is not logged.
    services = logging.getLogger("prefect._internal.concurrency")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    services.addHandler(handler)
    try:
        slot = Pool(hosts=[Host(name="lease-log-test")]).slots()[0]
        ensure_limits(Pool(hosts=[slot.host]))
        with try_lease(slot) as first:
            refused = []
            t = threading.Thread(target=lambda: refused.append(try_lease(slot).__enter__()))
            t.start()
            t.join()
        assert first and refused == [False]
        assert not [r for r in records if ACQUIRING_SERVICE in r.getMessage()], [r.getMessage() for r in records]

        # any other failure of the service is still logged as Prefect logs it
        def failed(status: int) -> Future:
            done: Future = Future()
            request = httpx.Request("POST", "http://prefect/v2/concurrency_limits/increment-with-lease")
            done.set_exception(PrefectHTTPStatusError("refused", request=request,
                                                      response=httpx.Response(status, request=request)))
            return done

        for status in (423, 500):
            services.error("Service %r failed to process item %r", ACQUIRING_SERVICE, (1, "concurrency", failed(status)))
        assert [r.args[1][-1].exception().response.status_code for r in records] == [500]
    finally:
        services.removeHandler(handler)


def test_a_group_lease_holds_gpus_of_one_host_and_waits_holding_none(prefect_server):
    pool = Pool(hosts=[Host(name="group-a", gpus=[0, 1], gpu_class="h200"),
                       Host(name="group-b", gpus=[0], gpu_class="h200")])
    ensure_limits(pool)
    a0, a1, b0 = pool.slots()
    assert pool.group_problem("any", 2) is None
    assert pool.group_problem("h200", 3) == "3 replicas need 3 GPUs of one host, and no host of the pool of " \
                                           "class h200 has more than 2"
    with lease_group(pool.slots, 2) as group:
        assert group == [a0, a1] and free_slots(pool.slots()) == [b0]
    got = []

    def wait_for_two():
        with lease_group(pool.slots, 2) as group:
            got.append(group)

    with try_lease(a0):  # one GPU of group-a taken: a group of two waits, taking neither of the others
        t = threading.Thread(target=wait_for_two)
        t.start()
        t.join(2.0)
        assert got == [] and free_slots(pool.slots()) == [a1, b0]
    t.join(30)
    assert got == [[a0, a1]] and free_slots(pool.slots()) == [a0, a1, b0]


def test_a_lease_on_a_limit_that_does_not_exist_is_refused(prefect_server):
    slot = Pool(hosts=[Host(name="never-created")]).slots()[0]
    with pytest.raises(Exception, match="must be created"):
        with try_lease(slot):
            pass


def test_a_restarted_flow_requeues_what_a_killed_flow_left_pending(prefect_server, tracking_home):
    """A killed flow leaves its parent RUNNING and its in-flight children pending: the next
    flow on the same target evaluates them once, under its own run, and retires the orphans."""
    target = Target(model="tiny", dtype="fp16", budget={"candidates": 1})
    tracker = Tracker(TrackingConfig.from_env())
    scope = scope_for("silu_mul", target, local_pool())
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent = tracker.start_parent("optimization", scope, "killed flow", params={})
    tracker.client.set_tag(parent, f"{T}controller", f"{socket.gethostname()}:{dead.pid}:")
    orphan = Candidate(op="silu_mul", kind="template", template="flat",
                       point={"block": 256, "num_warps": 4, "num_stages": 1}, origin="random")
    orphan_run = tracker.open_candidate(parent, scope, orphan)

    result = optimize_op(op="silu_mul", target=target, proposer="random", seed=5)
    runs = [r for r in search(tracker, "silu_mul") if r.data.tags.get("mlflow.parentRunId") == result["parent_run_id"]]
    assert len(runs) == 1
    assert runs[0].data.tags[f"{T}candidate_id"] == orphan.id
    assert runs[0].data.tags[f"{T}requeued_from"] == orphan_run
    # a valid point of the shipped template: evaluated again, it passes and is scored
    tags = runs[0].data.tags
    assert tags[f"{T}status"] == "pass", tags.get(f"{T}failing_gate")
    assert runs[0].data.metrics["score"] > 0
    assert tracker.client.get_run(orphan_run).info.lifecycle_stage == "deleted"
    pending = [r for r in search(tracker, "silu_mul", status="pending") if r.data.tags.get(f"{T}target") == target.key()]
    assert pending == []


def test_the_example_pool_file_in_infra_is_valid():
    pool = load_pool(Path(__file__).parent.parent / "infra" / "pool.example.yaml")
    assert {s.host.gpu_class for s in pool.slots()} == {"h100", "b200"} and len(pool.slots()) == 10
