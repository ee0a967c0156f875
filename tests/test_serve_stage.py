"""The end-to-end stage on the tiny dense checkpoint, on the CPU: two replicas of the real engine
server against two of the real HF transformers reference server, each pair behind the load
balancer, under real AIPerf load, on a pool host reached over SSH (an sshd on loopback); one
replica of two streaming a fixed token rejected by the accuracy gate, on this machine's slot and
on the pool host (where the controller judges every replica); a server dying mid-run is a crash
with its log kept, and the flow goes on. A host without the model directory is one line; a
session the controller gives up on leaves no server behind; a pool host's GPUs go one to each
replica. A baseline named by engine (vllm, sglang) expands to its server command, and a machine or
host whose python lacks the engine is one line before anything starts (a fake vllm package on a
host's python shows the other side). The gates' rules themselves on hand-made completions and metrics."""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from loopback_sshd import loopback_hosts
from tiny_checkpoints import checkpoint

from cli.main import main
from contract.serve import METRICS, AccuracyRules, Completion, PatternRun, Served, compare
from contract.verdict import Verdict
from harness.serve.accuracy import judge

FAKES = Path(__file__).resolve().parent / "serve_fakes"
# One small pattern: AIPerf's own start-up (~10 s) dominates; the requests are a second's work.
SERVING = {"traffic": [{"name": "chat-short", "concurrency": 2, "input_tokens_mean": 24,
                        "output_tokens_mean": 8, "request_count": 6, "warmup_requests": 1}],
           "accuracy": {"held_out": 2, "held_out_tokens": 12, "max_tokens": 6}}
ENGINE = (f"{sys.executable} -m engine_templates.engine serve --model-dir {{model_dir}} --port {{port}} "
          f"--served-model-name {{name}} --dtype fp32 --max-model-len 512")


@pytest.fixture(scope="module")
def serving_file(tmp_path_factory):
    """Two replicas of every server: on the CPU they share its cores, which is enough to show
    the balancer spreads the load and every replica is judged."""
    path = tmp_path_factory.mktemp("serve") / "serving.json"
    path.write_text(json.dumps(SERVING | {"replicas": 2}))
    return path


def served_per_backend(balancer_log: str) -> list[int]:
    """What the balancer said at its exit: requests each backend served."""
    return [int(n) for n in re.findall(r"backend \d+ \(\S+\): (\d+) requests", balancer_log)]


@pytest.fixture(scope="module")
def pool_host(tmp_path_factory):
    """One pool host over real SSH on loopback: its sessions run the servers and AIPerf "there"."""
    root = tmp_path_factory.mktemp("serve-ssh")
    with loopback_hosts(root, ("serve-host",)) as loop:
        host = loop.host(loop.servers[0])
        pool_file = root / "pool.yaml"
        pool_file.write_text(yaml.safe_dump({"hosts": [host.model_dump(mode="json")]}))
        yield host, pool_file


def bench(serving_file, *extra) -> tuple[int, str]:
    # stdout only: Prefect's log handler keeps the stderr it first saw, so no capsys here
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["serve-bench", "--model-dir", str(checkpoint("dense")), "--model", "tiny", "--dtype", "fp32",
                     "--serving", str(serving_file), *extra])
    return code, out.getvalue()


def child_runs(tracker_client, parent_id):
    runs = tracker_client.search_runs([tracker_client.get_run(parent_id).info.experiment_id],
                                      f"tags.mlflow.parentRunId = '{parent_id}'")
    return sorted(runs, key=lambda r: r.info.start_time)


def test_engine_vs_reference_on_a_pool_host_under_aiperf_with_metrics_in_mlflow(prefect_server, tracking_home,
                                                                               serving_file, pool_host):
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    host, pool_file = pool_host
    code, out = bench(serving_file, "--json", "--pool", str(pool_file))
    result = json.loads(out)
    gates = {g["name"]: g for g in result["gates"]}
    # before load, and under it: 3 of the accuracy prompts through the balancer meanwhile, judged by
    # the controller too
    before, under = [g for g in result["gates"] if g["name"] == "accuracy"]
    assert before["passed"], before["detail"]
    assert under["passed"] and under["detail"].startswith("under load on pattern chat-short: 3 prompts ("), under
    assert "all_metrics" in gates and result["verdict"] in ("pass", "fail")  # CPU timings: either way
    assert code == (0 if result["verdict"] == "pass" else 1)
    rows = {r["metric"]: r for r in result["table"]}
    # TTFT and total throughput only: a loaded CPU can deliver a tiny model's tokens in one read,
    # which AIPerf rightly counts as an inter-token latency of 0 (and per-user throughput as none).
    assert set(rows) == set(METRICS)
    assert all(rows[k]["candidate"] > 0 and rows[k]["baseline"] > 0 for k in ("ttft_p50_ms", "output_tps"))

    client = Tracker(TrackingConfig.from_env()).client
    run = client.get_run(result["run_id"])
    m = run.data.metrics
    assert m["chat-short/ttft_p50_ms"] == rows["ttft_p50_ms"]["candidate"] > 0
    assert m["chat-short/baseline_output_tps"] == rows["output_tps"]["baseline"] and "score" in m
    assert m["accuracy/max_logprob_diff"] < 1e-3 and m["accuracy/tokens_compared"] > 0
    assert m["chat-short/under_load_prompts"] == 3 and m["chat-short/under_load_max_logprob_diff"] < 1e-3
    assert m["chat-short/under_load_tokens_compared"] > 0 and "chat-short/under_load_overlapped" in m
    assert run.data.tags["infersmith.status"] == result["verdict"]
    exported = client.download_artifacts(run.info.run_id, "serve/aiperf/chat-short/profile_export_aiperf.json")
    assert json.loads(Path(exported).read_text())["request_count"]["avg"] == 6
    parent = client.get_run(result["parent_run_id"]).data.metrics
    assert parent["baseline/chat-short/output_tps"] == rows["output_tps"]["baseline"]
    # The sessions ran on the host, and what they wrote came back: the worker's log, AIPerf's exports.
    assert run.data.tags["infersmith.host"] == "serve-host"
    worker_log = Path(client.download_artifacts(run.info.run_id, "serve/worker.log")).read_text()
    assert "Traceback" not in worker_log
    baseline = Path(client.download_artifacts(result["parent_run_id"], "baseline"))
    assert (baseline / "aiperf" / "chat-short" / "profile_export_aiperf.json").is_file()
    # Both sides two replicas behind a balancer on the host that spread AIPerf's 7 requests and the
    # 3 accuracy prompts sent meanwhile (to the baseline too: the same load) over both; the
    # controller judged each replica (the host's own gate only says it asked).
    assert "replica 0: " in before["detail"] and "replica 1: " in before["detail"]
    for run_id, folder in ((run.info.run_id, "serve"), (result["parent_run_id"], "baseline")):
        logs = Path(client.download_artifacts(run_id, folder))
        assert "serving infersmith-e2e" in (logs / "server-1.log").read_text()
        served = served_per_backend((logs / "balancer.log").read_text())
        assert len(served) == 2 and min(served) > 0 and sum(served) == 7 + 3, (folder, served)
    # The reference's answers and the held-out prompts stayed in memory, and the host keeps no session.
    assert not list(baseline.rglob("answers.json")) and not list(baseline.rglob("job.json"))
    assert list((Path(host.workdir) / "runs").iterdir()) == []


@pytest.mark.parametrize("where", ["this machine", "pool host"])
def test_one_replica_streaming_a_fixed_token_is_rejected_by_the_accuracy_gate(prefect_server, tracking_home,
                                                                              serving_file, request, where):
    # Replica 0 the engine, replica 1 the fixed-token server. A baseline command other than the
    # reference is measured only for a candidate worth comparing. On the pool host the detail is
    # the controller's: the host's gate only says it was judged there.
    pool = ["--pool", str(request.getfixturevalue("pool_host")[1])] if where == "pool host" else []
    fake = f"{sys.executable} {FAKES / 'fixed_token_server.py'} {{port}}"
    either = f"sh -c 'if [ {{replica}} = 1 ]; then exec {fake}; else exec {ENGINE}; fi'"
    code, out = bench(serving_file, "--candidate", either, "--baseline", f"{sys.executable} -c 'raise SystemExit(9)'",
                      *pool)
    assert code == 1
    assert "accuracy: FAILED  replica 1: prompt 0 (shown), token 0: greedy token 17" in out
    assert "verdict: fail  [accuracy]" in out and "all_metrics" not in out


def batching_bug_gates(tmp_path, request, where: str, mode: str = "") -> tuple[str, str, str]:
    """serve-bench of tests/serve_fakes/batching_bug_server.py (in `mode`) here or on the pool host,
    against a baseline that never starts: the accuracy lines before and under load (the first
    passed), and the whole output."""
    pool = ["--pool", str(request.getfixturevalue("pool_host")[1])] if where == "pool host" else []
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps(SERVING))
    fake = f"{sys.executable} {FAKES / 'batching_bug_server.py'} {{port}} {{model_dir}} {{name}} {mode}".rstrip()
    code, out = bench(serving, "--candidate", fake, "--baseline", f"{sys.executable} -c 'raise SystemExit(9)'", *pool)
    assert code == 1, out
    before, under = [line for line in out.splitlines() if line.startswith("accuracy: ")]
    assert before.startswith("accuracy: ok  6 prompts (2 held out), "), out
    return before, under, out


@pytest.mark.parametrize("where", ["this machine", "pool host"])
def test_an_engine_wrong_only_in_company_passes_before_load_and_fails_under_it(prefect_server, tracking_home,
                                                                              tmp_path, request, where):
    # The real engine behind a relay that corrupts a whole completion which shared the server with
    # another request: the accuracy prompts, one at a time before load, are right; those sent while
    # AIPerf loads it are not. On the pool host the controller judges both rounds.
    before, under, out = batching_bug_gates(tmp_path, request, where)
    assert "0 prompts diverged" in before, out
    assert re.match(r"accuracy: FAILED  under load on pattern chat-short: prompt \d \((shown|held out)\), token 0: "
                    r"greedy token \d+, the reference's is \d+ .*; 3 of 3 overlapped AIPerf's measured requests", under), out
    assert "verdict: fail  [accuracy] under load on pattern chat-short: prompt" in out and "all_metrics" not in out


@pytest.mark.parametrize("where", ["this machine", "pool host"])
def test_an_engine_that_replays_its_answers_under_load_fails_on_the_fresh_prompt(prefect_server, tracking_home,
                                                                                tmp_path, request, where):
    # As above, and it also keeps every completion it gave right and gives it again for the same
    # request: the prompts asked again under load come back right from its store; the pattern's
    # fresh held-out prompt (number 6, after the 4 shown and 2 held out) it must answer while
    # crowded. On the pool host it also answers, alone and first, every prompt the session's file
    # holds: the fresh one is not there before its pattern.
    before, under, out = batching_bug_gates(tmp_path, request, where, "peek" if where == "pool host" else "cache")
    assert re.match(r"accuracy: FAILED  under load on pattern chat-short: prompt 6 \(held out\), token 0: ", under), out


def test_completions_planted_on_the_host_before_the_worker_writes_fail_the_gate(prefect_server, tracking_home,
                                                                                 serving_file, pool_host):
    # The candidate's servers run as the host's user in the session folder: one writes the file the
    # worker hands the answers over in, claiming no answers at all, before the worker asks anything.
    fake = f"{sys.executable} {FAKES / 'fixed_token_server.py'} {{port}} exchange/completions.json"
    code, out = bench(serving_file, "--candidate", fake, "--baseline", f"{sys.executable} -c 'raise SystemExit(9)'",
                      "--pool", str(pool_host[1]))
    assert code == 1 and "verdict: fail  [accuracy]" in out and "all_metrics" not in out
    assert "accuracy: FAILED  answers from 1 replicas, 2 were started" in out or "accuracy: FAILED  0 answers to" in out, out


def test_a_server_dying_mid_run_is_a_crash_with_its_log_and_the_flow_goes_on(prefect_server, tmp_path, monkeypatch):
    from flows.optimize_engine import optimize_engine
    from targets import Target
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    # A store of its own: a configuration the session's store already holds for this serving scope
    # counts as tried, and the flow would skip the one included here.
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    # The engine itself as the baseline (a command): the flow's baseline is any OpenAI-compatible server.
    target = Target.model_validate({"model": "tiny", "dtype": "fp32", "budget": {"candidates": 2},
                                    "serving": SERVING | {"baseline": ENGINE}})
    dying = {"kernels": {"silu_mul": {"impl": "free", "path": str(FAKES / "dying_silu_mul.py")}}}
    result = optimize_engine(str(checkpoint("dense")), target, seed=1, kernels_per_op=0, include=[dying])
    assert result["candidates"] == 2

    client = Tracker(TrackingConfig.from_env()).client
    assert client.get_run(result["parent_run_id"]).data.params["proposer"] == "tpe"  # the default
    runs = child_runs(client, result["parent_run_id"])  # by proposer: the runs may open in either order
    assert sorted(r.data.tags["infersmith.proposer"] for r in runs) == ["include", "tpe"]
    [died] = [r for r in runs if r.data.tags["infersmith.proposer"] == "include"]
    [fine] = [r for r in runs if r.data.tags["infersmith.proposer"] == "tpe"]
    assert died.data.tags["infersmith.status"] == "crash"
    assert died.data.tags["infersmith.failing_gate"] == "server_died"
    verdict = json.loads(Path(client.download_artifacts(died.info.run_id, "verdict.json")).read_text())
    assert "during pattern chat-short" in verdict["gates"][-1]["detail"]
    assert [g["name"] for g in verdict["gates"]] == ["accuracy", "server_died"] and verdict["gates"][0]["passed"]
    log = Path(client.download_artifacts(died.info.run_id, "serve/server.log")).read_text()
    assert "serving infersmith-e2e" in log
    assert fine.data.tags["infersmith.status"] in ("pass", "fail")
    assert fine.data.tags["infersmith.failing_gate"] in ("", "all_metrics")
    assert fine.data.metrics["chat-short/ttft_p50_ms"] > 0 and fine.data.metrics["chat-short/baseline_output_tps"] > 0


RULES = AccuracyRules(prompts=("a",), held_out=1, held_out_tokens=4, max_tokens=3, logprob_atol=0.01, tie_nats=0.05)
REF = [Completion([5, 6, 7], [-0.1, -0.2, -0.3], [{5: -0.1, 9: -2.0}, {6: -0.2, 8: -0.22}, {7: -0.3}])] * 2


@pytest.mark.parametrize("got, passed, says", [
    ([Completion([5, 6, 7], [-0.1, -0.205, -0.3], [])] * 2, True, "0 prompts diverged"),
    ([Completion([5, 8, 1], [-0.1, -0.22, -5.0], [])] * 2, True, "2 prompts diverged at a near-tie"),
    ([Completion([9, 6, 7], [-2.0, -0.2, -0.3], [])] * 2, False, "greedy token 9, the reference's is 5"),
    ([Completion([5, 6, 7], [-0.1, -0.5, -0.3], [])] * 2, False, "prompt 0 (shown), token 1: logprob"),
    ([Completion([5, 6], [-0.1, -0.2], [])] * 2, False, "2 tokens with 2 logprobs, expected 3"),
])
def test_accuracy_rules(got, passed, says):
    ok, detail, _ = judge(got, REF, RULES)
    assert ok is passed and says in detail


def test_fewer_answers_than_prompts_or_no_replica_fail_the_gate():
    from harness.serve.stage import judge_replicas

    good = [Completion([5, 6, 7], [-0.1, -0.2, -0.3], [])]
    assert judge(good, REF, RULES)[:2] == (False, "1 answers to 2 prompts")
    assert judge([], REF, RULES)[0] is False
    assert judge_replicas([good * 2, []], REF, RULES)[:2] == (False, "replica 1: 0 answers to 2 prompts")
    assert judge_replicas([], REF, RULES)[:2] == (False, "no replica's answers")
    assert judge_replicas([good * 2], REF, RULES)[0] is True


def test_the_prompts_sent_under_load_are_the_same_wherever_drawn_and_hold_a_held_out_one():
    from harness.serve.under_load import sample

    for pattern in ("chat-short", "long-prompt", "concurrency-32", "structured"):
        got = sample(8, 4, 3, pattern)  # 4 shown, then 4 held out
        assert got == sample(8, 4, 3, pattern) and len(set(got)) == 3 and any(n >= 4 for n in got)
        assert sample(8, 4, 1, pattern)[0] >= 4
    assert sample(8, 4, 0, "p") == [] and sample(2, 0, 3, "p") == [0, 1]
    # With a fresh prompt (drawn for the pattern alone): it, last, and k - 1 of those asked before load.
    for pattern in ("chat-short", "structured", "long-context"):
        got = sample(8, 4, 3, pattern, fresh=9)
        assert got == sample(8, 4, 3, pattern, fresh=9) and got[-1] == 9 and len(set(got)) == 3
        assert all(n < 8 for n in got[:-1])
    assert sample(8, 4, 1, "p", fresh=9) == [9] and sample(1, 0, 3, "p", fresh=1) == [0, 1]


def test_each_patterns_fresh_prompt_is_asked_under_its_load_only():
    from contract.serve import Pattern
    from harness.serve.stage import fresh_prompts, prompt_numbers

    rules = AccuracyRules(prompts=("a", "b"), held_out=2, held_out_tokens=4, max_tokens=4, logprob_atol=0.1,
                          tie_nats=0.1, under_load=3)
    job = SimpleNamespace(accuracy=rules, patterns=(Pattern("one"), Pattern("two")))
    assert fresh_prompts(job) == 2
    assert prompt_numbers(job, 6, None) == [0, 1, 2, 3]  # before load: none of the fresh ones
    assert prompt_numbers(job, 6, "one")[-1] == 4 and prompt_numbers(job, 6, "two")[-1] == 5
    assert all(n < 4 for p in ("one", "two") for n in prompt_numbers(job, 6, p)[:-1])
    off = SimpleNamespace(accuracy=replace(rules, under_load=0), patterns=job.patterns)
    assert fresh_prompts(off) == 0 and prompt_numbers(off, 4, None) == [0, 1, 2, 3] and prompt_numbers(off, 4, "one") == []


def test_overlap_counts_aiperfs_measured_requests_only(tmp_path):
    from harness.serve.under_load import overlap

    records = tmp_path / "profile_export.jsonl"
    rows = [("warmup", 0, 100), ("profiling", 100, 200), ("profiling", 150, 300)]
    records.write_text("".join(json.dumps({"metadata": {"benchmark_phase": phase, "request_start_ns": start,
                                                        "request_end_ns": end}}) + "\n" for phase, start, end in rows))
    assert overlap([(50, 90)], records) == (0, 0)  # beside the warm-up only
    assert overlap([(120, 160), (250, 260), (400, 500)], records) == (2, 2)
    assert overlap([(1, 2)], tmp_path / "missing.jsonl") == (0, 0)


@pytest.mark.parametrize("host_gates, judged, says", [
    # loaded, and the host said nothing of the prompts sent meanwhile
    ([], {}, "under load on pattern chat-short: the candidate's completions never reached the controller"),
    # the host's word that they passed, against the controller's judgement
    (["under load on pattern chat-short: judged on the controller; 3 of 3 overlapped"],
     {"chat-short": (False, "prompt 5 (held out), token 0: greedy token 9", {})},
     "under load on pattern chat-short: prompt 5 (held out), token 0: greedy token 9; 0 of 0 overlapped"),
])
def test_the_controller_judges_the_prompts_under_load_not_the_host(tmp_path, host_gates, judged, says):
    from gpu_pool.ssh_serve import own_accuracy

    verdict = Verdict(op="engine", candidate_id="x")
    for detail in ["judged on the controller", *host_gates]:
        verdict.gate("accuracy", True, detail)
    served = Served(verdict, {"chat-short": PatternRun("chat-short", {}, 0, tmp_path)})
    own_accuracy(served, {None: (True, "6 prompts (2 held out)", {})} | judged, ("chat-short",))
    assert verdict.status == "fail" and verdict.failing_gate.detail.startswith(says)
    assert verdict.gates[0].passed and verdict.gates[0].detail == "6 prompts (2 held out)"


def test_under_load_is_on_by_default_and_part_of_the_serving_key():
    from targets import Target

    on = Target(model="tiny")
    off = Target.model_validate({"model": "tiny", "serving": {"accuracy": {"under_load": 0}}})
    assert on.accuracy_rules().under_load == 3 and off.accuracy_rules().under_load == 0
    assert on.serve_key() != off.serve_key()  # the prompts under load are part of the load both sides serve


def test_every_metric_must_beat_the_baseline_by_the_margin(tmp_path):
    base = {name: 10.0 for name in METRICS}
    better = {name: 12.0 if higher else 8.0 for name, (_, _, higher) in METRICS.items()}
    served = Served(Verdict(op="engine", candidate_id="x"), {"p": PatternRun("p", better, 0, tmp_path)})
    compare(served, {"p": PatternRun("p", base, 0, tmp_path)}, margin=0.1)
    assert served.verdict.status == "pass" and math.isclose(served.metrics["worst_vs_baseline"], 1.2)
    one_short = better | {"itl_p90_ms": 9.5}  # better, but by less than the margin
    served = Served(Verdict(op="engine", candidate_id="x"), {"p": PatternRun("p", one_short, 0, tmp_path)})
    compare(served, {"p": PatternRun("p", base, 0, tmp_path)}, margin=0.1)
    assert served.verdict.status == "fail"
    assert served.verdict.failing_gate.detail.startswith("1 of 7 metrics short") and "p/itl_p90_ms 9.5" in \
        served.verdict.failing_gate.detail


def test_aiperf_counts_the_tokens_a_server_streams_not_those_its_usage_claims(tmp_path):
    """A server whose `usage` claims 40 times the tokens it streams: AIPerf tokenizes what arrived
    (with the model's tokenizer), so the claim buys no throughput."""
    from loopback_sshd import free_port
    from tokenizers import Tokenizer

    from contract.serve import Pattern
    from harness.serve import aiperf
    from harness.serve.server import ServerProcess

    model_dir = checkpoint("dense")
    port = free_port()
    server = ServerProcess("inflating", [sys.executable, str(FAKES / "inflating_usage_server.py"), str(port)],
                           tmp_path / "server.log", {}, port).start(60)
    try:
        run = aiperf.run(Pattern(name="p", input_tokens_mean=16, output_tokens_mean=8, request_count=4,
                                 warmup_requests=0), server.url, "any", model_dir, tmp_path / "aiperf", 300)
    finally:
        server.stop()
    export = json.loads((run.out_dir / aiperf.EXPORT).read_text())
    streamed = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(" the" * 8,
                                                                                 add_special_tokens=False).ids)
    assert run.errors == 0 and run.metrics["requests"] == 4
    assert export["output_sequence_length"]["avg"] == streamed
    assert export["usage_completion_tokens"]["avg"] == 40 * 8  # claimed, and not counted
    assert export["total_output_tokens"]["avg"] == 4 * streamed


@pytest.mark.parametrize("side, name, value", [
    ("candidate", "itl_p50_ms", 0.0),  # every token in one read: no latency to speak of
    ("candidate", "ttft_p90_ms", 0.0),
    ("candidate", "output_tps", 0.0),
    ("baseline", "itl_p90_ms", 0.0),
    ("candidate", "itl_p50_ms", math.nan),
])
def test_a_metric_of_zero_on_either_side_fails_the_gate_and_stays_out_of_the_score(tmp_path, side, name, value):
    base = {n: 10.0 for n in METRICS}
    better = {n: 12.0 if higher else 8.0 for n, (_, _, higher) in METRICS.items()}
    if side == "candidate":
        better[name] = value
    else:
        base[name] = value
    served = Served(Verdict(op="engine", candidate_id="x"), {"p": PatternRun("p", better, 0, tmp_path)})
    compare(served, {"p": PatternRun("p", base, 0, tmp_path)}, margin=0.1)
    assert served.verdict.status == "fail"
    assert served.verdict.failing_gate.detail == (f"1 of 7 metrics short of the baseline by 10%: p/{name} "
                                                  f"{better[name]:.4g} vs baseline {base[name]:.4g} (not a "
                                                  "measurement: each must be above 0)")
    assert f"p/vs_baseline_{name}" not in served.metrics and math.isclose(served.metrics["worst_vs_baseline"], 1.2)


@pytest.mark.parametrize("argv, message", [
    (["--model-dir", "/no/such/dir"], "not a model directory"),
    (["--patterns", "nope"], "no traffic pattern nope"),
    (["--kernels", "/no/such/kernels.json"], "cannot read kernels file"),
    (["--margin", "-1"], "bad serving settings: margin"),
])
def test_serve_bench_usage_errors_are_one_line(capsys, argv, message):
    args = ["serve-bench", "--model-dir", str(checkpoint("dense")), "--model", "tiny", *argv]
    capsys.readouterr()  # making the checkpoint prints progress
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("replicas, message", [
    (2, "serving.replicas: 2 replicas need 2 GPUs of one host, and no host of the pool has more than 1"),
    (0, "bad serving settings: replicas: Input should be greater than 0"),
])
def test_replicas_no_host_can_run_are_one_line(capsys, tmp_path, replicas, message):
    (tmp_path / "pool.yaml").write_text("hosts:\n  - {name: one-gpu, gpus: [0], gpu_class: h200}\n")
    (tmp_path / "serving.json").write_text(json.dumps(SERVING | {"replicas": replicas}))
    model_dir = str(checkpoint("dense"))
    capsys.readouterr()  # making the checkpoint prints progress
    assert main(["serve-bench", "--model-dir", model_dir, "--model", "tiny", "--pool",
                 str(tmp_path / "pool.yaml"), "--serving", str(tmp_path / "serving.json")]) == 2
    assert capsys.readouterr().err.strip() == f"infersmith: {message}"


def test_a_model_directory_missing_on_the_host_is_one_line(pool_host, capsys, tmp_path):
    from gpu_pool.pool import Pool
    from gpu_pool.ssh_serve import ServeSetupError, SSHServe
    from targets import Target
    from tasks.serve import job_for

    host, pool_file = pool_host
    # Before the run: the host is asked, and no flow starts.
    assert main(["serve-bench", "--model-dir", "/no/such/dir", "--model", "tiny", "--pool", str(pool_file)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "infersmith: host serve-host: no model directory /no/such/dir (it must be there: " \
                          "checkpoints are not shipped)"
    # In a session (a host that lost it since): the run's error, as one line.
    slot = Pool(hosts=[host]).slots()[0]
    with pytest.raises(ServeSetupError, match=r"^host serve-host: no model directory /no/such/dir \(") as e:
        SSHServe([slot]).baseline(job_for(Target(model="tiny"), Path("/no/such/dir"), [slot]), tmp_path)
    assert "\n" not in str(e.value)


def test_a_session_the_controller_gives_up_on_leaves_no_server_on_the_host(pool_host, tmp_path):
    from contract.serve import ServerError
    from gpu_pool.pool import Pool
    from gpu_pool.ssh_serve import SSHServe
    from targets import Target
    from tasks.serve import job_for

    host, _ = pool_host
    slot = Pool(hosts=[host]).slots()[0]
    token = f"never-ready-{tmp_path.name}"  # names the hanging servers' processes
    hang = f"{sys.executable} -c \"print('warming up', flush=True); import time; time.sleep(300)\" {token}"
    target = Target.model_validate({"model": "tiny", "serving": SERVING | {"baseline": hang, "start_timeout_s": 120,
                                                                           "replicas": 2}})
    model_dir = tmp_path / "model"  # what a baseline session reads of it: that it is there
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model_dir / name).write_text("{}")
    out = tmp_path / "out"
    with pytest.raises(ServerError, match="ran past its 5 s limit and was killed"):
        SSHServe([slot], limit_s=5).baseline(job_for(target, model_dir, [slot]), out)
    for replica in (0, 1):  # what they wrote came back
        assert "warming up" in (out / f"server-{replica}.log").read_text()
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and token.encode() in _cmdline(p)]
    assert left == [], "a baseline replica outlived its session"
    assert list((Path(host.workdir) / "runs").iterdir()) == []


def test_a_host_dropping_mid_session_is_a_host_fault_for_the_dispatch(tmp_path):
    """The host's sshd dies while its baseline server starts: a HostFault (which the dispatch benches
    and retries elsewhere), not a hang nor a verdict on anyone's server."""
    import threading

    from gpu_pool.health import HostFault
    from gpu_pool.pool import Pool
    from gpu_pool.ssh_serve import SSHServe
    from targets import Target
    from tasks.serve import job_for

    hang = f"{sys.executable} -c \"print('warming up', flush=True); import time; time.sleep(300)\""
    target = Target.model_validate({"model": "tiny", "serving": SERVING | {"baseline": hang, "start_timeout_s": 120}})
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model_dir / name).write_text("{}")
    with loopback_hosts(tmp_path / "ssh", ("doomed",)) as loop:
        host = loop.host(loop.servers[0])
        runs = Path(host.workdir) / "runs"

        returned = threading.Event()

        def drop_once_serving():
            while not returned.is_set():  # however long the session takes to start its server
                if any((d / "out" / "server.log").exists() for d in (runs.iterdir() if runs.exists() else ())):
                    loop.servers[0].kill()
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=drop_once_serving, daemon=True)
        killer.start()
        slot = Pool(hosts=[host]).slots()[0]
        t0 = time.monotonic()
        try:
            with pytest.raises(HostFault, match="connection"):
                SSHServe([slot]).baseline(job_for(target, model_dir, [slot]), tmp_path / "out")
        finally:
            returned.set()
        killer.join(timeout=1)
        # the drop ended it, long before the hanging baseline's start timeout (120 s) could
        assert loop.servers[0].proc.poll() is not None and time.monotonic() - t0 < 100


def test_a_pool_hosts_gpus_go_one_to_each_replica_there():
    """The job of a leased group on a GPU host: each replica its own GPU of the group, the host's
    python, the model directory as a path there; and it crosses the wire to the host intact."""
    from gpu_pool.pool import Host, Pool
    from harness.serve.remote import job_from_dict, job_to_dict
    from targets import Target
    from tasks.serve import job_for

    host = Host(name="h200-a", address="10.0.0.5", gpus=[2, 5, 7], gpu_class="h200", python="/opt/venv/bin/python")
    group = Pool(hosts=[host]).slots()[1:]  # GPUs 5 and 7, as a lease of two might hold them
    job = job_for(Target.model_validate({"model": "tiny", "serving": SERVING | {"replicas": 2}}),
                  Path("/data/tiny"), group)
    assert job.device == "cuda" and [e["CUDA_VISIBLE_DEVICES"] for e in job.replica_envs] == ["5", "7"]
    assert job.python == "/opt/venv/bin/python" and job.model_dir == Path("/data/tiny")
    assert "PYTHONPATH" not in job.env  # the host's worker sets its bundle's, which the servers inherit
    assert job_from_dict(json.loads(json.dumps(job_to_dict(job)))) == job


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_baseline_named_by_engine_expands_to_its_server_command():
    """`vllm` and `sglang` become that engine's server on the job's checkpoint, run by the job's
    python, on loopback, with the target's dtype and context length; a command stays a command."""
    from gpu_pool.pool import Host, Pool
    from harness.serve.stage import baseline_argv
    from targets import Target
    from tasks.serve import job_for

    group = Pool(hosts=[Host(name="h200-a", address="10.0.0.5", gpus=[3], gpu_class="h200",
                             python="/opt/venv/bin/python")]).slots()

    def job(baseline: str, dtype: str):
        target = Target.model_validate({"model": "tiny", "dtype": dtype,
                                        "serving": SERVING | {"baseline": baseline, "max_model_len": 1024}})
        return job_for(target, Path("/data/tiny"), group)

    assert baseline_argv(job("vllm", "bf16"), 8123) == [
        "/opt/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/data/tiny", "--host", "127.0.0.1",
        "--port", "8123", "--served-model-name", "infersmith-e2e", "--dtype", "bfloat16", "--max-model-len", "1024"]
    assert baseline_argv(job("sglang", "fp16"), 8124) == [
        "/opt/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/data/tiny", "--host", "127.0.0.1",
        "--port", "8124", "--served-model-name", "infersmith-e2e", "--dtype", "float16", "--context-length", "1024"]
    command = "vllm serve {model_dir} --port {port} --served-model-name {name} --seed {replica}"
    assert baseline_argv(job(command, "fp32"), 9000, 1) == [
        "vllm", "serve", "/data/tiny", "--port", "9000", "--served-model-name", "infersmith-e2e", "--seed", "1"]


@pytest.mark.parametrize("engine, module, via", [("vllm", "vllm.entrypoints.cli.main serve", "option"),
                                                 ("sglang", "sglang.launch_server", "serving file")])
def test_a_baseline_engine_this_machine_lacks_is_one_line_and_nothing_starts(capsys, tmp_path, monkeypatch,
                                                                          engine, module, via):
    import importlib.util
    import tempfile

    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"this machine has {engine}")
    model_dir = str(checkpoint("dense"))
    marker = tmp_path / "candidate-started"  # the candidate server, were it started, leaves this
    candidate = f"{sys.executable} -c \"import pathlib; pathlib.Path('{marker}').touch()\""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a flow's session would make its folder
    if via == "option":
        choice = ["--baseline", engine]
    else:
        (tmp_path / "serving.json").write_text(json.dumps(SERVING | {"baseline": engine}))
        choice = ["--serving", str(tmp_path / "serving.json")]
    capsys.readouterr()  # making the checkpoint prints progress
    assert main(["serve-bench", "--model-dir", model_dir, "--model", "tiny", "--candidate", candidate, *choice]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"infersmith: host local: {sys.executable} cannot import {engine}, which the baseline "
                           f"'{engine}' needs (python -m {module}); install {engine} into that environment or "
                           f"name another baseline")
    assert not marker.exists() and [p.name for p in tmp_path.iterdir()] == (["serving.json"] if via != "option"
                                                                            else [])


def test_a_fake_vllm_on_a_hosts_python_is_detected_and_its_serve_command_runs_there(pool_host, capsys, tmp_path):
    """A pool host whose python imports a (tiny, real) vllm package: pool check shows its version,
    the pre-run check passes, and a baseline session runs `python -m vllm.entrypoints.cli.main serve`
    with the expanded arguments there (the fake prints them and exits 3). The same host lacks
    sglang: one line before the run, and the session's own check refuses it too."""
    from contract.serve import ServerError
    from gpu_pool.check import probe, serve_problems
    from gpu_pool.pool import Pool
    from gpu_pool.ssh_serve import ServeSetupError, SSHServe
    from targets import Target
    from tasks.serve import job_for

    site = tmp_path / "site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (cli, cli.parent, cli.parent.parent):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text("import json, sys\nprint('fake vllm', json.dumps(sys.argv[1:]), flush=True)\n"
                                 "sys.exit(3)\n")
    (site / "vllm-0.0.1.dist-info").mkdir()
    (site / "vllm-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n")
    python = tmp_path / "python"  # the host's python: this one, with the fake on its path
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    host = pool_host[0].model_copy(update={"python": str(python)})
    model_dir = tmp_path / "model"  # what the checks and a baseline session read of it: that it is there
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model_dir / name).write_text("{}")

    info = probe(host)
    assert (info["vllm"], info["sglang"]) == ("0.0.1", "missing")
    assert serve_problems(host, str(model_dir), "vllm") == []
    lacks_sglang = (f"{sys.executable} cannot import sglang, which the baseline 'sglang' needs (python -m "
                    f"sglang.launch_server); install sglang into that environment or name another baseline")
    pool_file = tmp_path / "pool.yaml"
    pool_file.write_text(yaml.safe_dump({"hosts": [host.model_dump(mode="json")]}))
    assert main(["serve-bench", "--model-dir", str(model_dir), "--model", "tiny", "--pool", str(pool_file),
                 "--baseline", "sglang"]) == 2
    assert capsys.readouterr().err.strip() == f"infersmith: host serve-host: {lacks_sglang}"

    slot = Pool(hosts=[host]).slots()[0]
    target = Target.model_validate({"model": "tiny", "dtype": "fp16",
                                    "serving": SERVING | {"baseline": "vllm", "max_model_len": 512}})
    out = tmp_path / "out"
    with pytest.raises(ServerError, match="baseline server exited with code 3 while starting"):
        SSHServe([slot]).baseline(job_for(target, model_dir, [slot]), out)
    argv = json.loads((out / "server.log").read_text().split("fake vllm ", 1)[1].splitlines()[0])
    port = argv[argv.index("--port") + 1]
    assert argv == ["serve", str(model_dir), "--host", "127.0.0.1", "--port", port, "--served-model-name",
                    "infersmith-e2e", "--dtype", "float16", "--max-model-len", "512"] and port.isdigit()
    sglang = target.model_copy(update={"serving": target.serving.model_copy(update={"baseline": "sglang"})})
    with pytest.raises(ServeSetupError, match=re.escape(f"host serve-host: {lacks_sglang}")):
        SSHServe([slot]).baseline(job_for(sglang, model_dir, [slot]), tmp_path / "out-sglang")
