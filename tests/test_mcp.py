"""`infersmith mcp` as an agent meets it: the `mcp` SDK's own client starts the command over stdio
and uses every tool; the candidates it sends are judged by the gates and logged like any other."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import Implementation

from targets.held_out import PREFIX, WITHHELD
from tracking.history import search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

ROOT = Path(__file__).resolve().parent.parent
RMS = ROOT / "gauntlet" / "rmsnorm"


def _server(home: Path, *extra: str) -> StdioServerParameters:
    """The installed command's module, on this checkout, against the test Prefect server."""
    from prefect.settings import get_current_settings

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {"PYTHONPATH": str(ROOT), "PREFECT_API_URL": get_current_settings().api.url, "TRITON_INTERPRET": "1"}
    return StdioServerParameters(command=sys.executable, args=["-m", "cli", "mcp", "--model", "tiny",
                                                               "--home", str(home), *extra], env=env, cwd=str(ROOT))


def _data(result) -> object:
    assert not result.is_error, result.content
    return result.structured_content.get("result", result.structured_content)


async def _session(home: Path, calls, *extra: str):
    async with stdio_client(_server(home, *extra)) as (read, write):
        async with ClientSession(read, write, client_info=Implementation(name="test agent", version="1")) as s:
            await s.initialize()
            return await calls(s)


def test_an_agent_lists_describes_evaluates_and_reads_the_leaderboard(prefect_server, tmp_path):
    honest, cheat = (RMS / "honest_torch.py").read_text(), (RMS / "mutates_input.py").read_text()

    async def calls(s: ClientSession):
        tools = {t.name for t in (await s.list_tools()).tools}
        ops = _data(await s.call_tool("list_ops", {}))
        described = (await s.call_tool("describe_op", {"op": "rmsnorm"})).content[0].text
        unknown = await s.call_tool("describe_op", {"op": "nope"})
        passed = _data(await s.call_tool("evaluate", {"op": "rmsnorm", "source": honest, "input_tokens": 1200,
                                                      "cached_input_tokens": 300, "output_tokens": 450}))
        failed = _data(await s.call_tool("evaluate", {"op": "rmsnorm", "source": cheat}))
        board = _data(await s.call_tool("leaderboard", {"op": "rmsnorm"}))
        return tools, ops, described, unknown, passed, failed, board

    tools, ops, described, unknown, passed, failed, board = anyio.run(_session, tmp_path, calls)
    assert tools == {"list_ops", "describe_op", "evaluate", "leaderboard", "search_knowledge"}
    assert {o["op"]: o["fits_target"] for o in ops}["fused_moe"] is False  # tiny is dense
    assert "rmsnorm(x, weight, eps)" in described and "decode_b4" in described
    assert unknown.is_error and "unknown op 'nope'" in unknown.content[0].text

    assert passed["status"] == "pass" and passed["score"] > 0
    assert {t["shape"] for t in passed["timings"]} == {"decode_b1", "decode_b4", "prefill_40"}
    assert failed["status"] == "fail" and failed["failing_gate"] == "inputs_unchanged", failed["gates"]
    ids = {e["candidate_id"] for e in board}
    tracker = Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                     artifact_root=(tmp_path / "artifacts").as_uri()))
    runs = {r.info.run_id: r for r in search(tracker, "rmsnorm")}
    good, bad = runs[passed["run_id"]], runs[failed["run_id"]]
    # the gates decided the leaderboard: the honest module is on it, the cheat is not
    assert good.data.tags[f"{T}candidate_id"] in ids and bad.data.tags[f"{T}candidate_id"] not in ids
    for run in (good, bad):
        assert run.data.tags[f"{T}proposer"] == "agent:test-agent"
    assert bad.data.tags[f"{T}status"] == "fail" and bad.data.tags[f"{T}failing_gate"] == "inputs_unchanged"
    m = good.data.metrics
    assert (m["proposer_input_tokens"], m["proposer_cached_input_tokens"], m["proposer_output_tokens"]) == (1200, 300, 450)
    assert m["proposer_tokens"] == 1950
    # each candidate was checked on held-out shapes (3 shown, 2 awkward, 2 held out), and nothing
    # an agent reads names them
    correctness = next(g for g in passed["gates"] if g["name"] == "correctness")
    assert "over 7 shapes" in correctness["detail"], correctness
    assert PREFIX not in json.dumps([described, passed, failed, board])


def test_a_verdict_reaches_the_agent_without_seeds_held_out_details_or_the_process_log():
    from cli.mcp_server import agent_verdict

    gates = [{"name": "compile", "passed": True, "detail": "warmed 7 shapes in 1.0 s"},
             {"name": "accuracy", "passed": False, "detail": "held_out_decode_b5 (uniform inputs, seed 991): rel 0.9"},
             {"name": "caching", "passed": False, "detail": "decode_b4 (heavy inputs, seed 17): stale"}]
    verdict = {"status": "fail", "metrics": {}, "failing_gate": "accuracy", "gates": gates, "flags": [],
               "max_rel_error": 0.9, "timings": [], "device": {}, "log_tail": "x.shape = (5, 96)"}
    seen = agent_verdict({"run_id": "r", "verdict": verdict})
    assert [g["detail"] for g in seen["gates"]] == ["warmed 7 shapes in 1.0 s", WITHHELD,
                                                     "decode_b4 (heavy inputs): stale"]
    assert "log_tail" not in seen and "(5, 96)" not in json.dumps(seen)


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "'nope' is neither a model preset"),
    (["--model", "tiny", "--pool", "/no/such/pool.yaml"], "bad pool file"),
    (["--model", "tiny", "--gpu-class", "h200"], "no host of GPU class h200"),
    (["--model", "tiny", "--decode-batches", "1,x"], "comma-separated integers"),
])
def test_bad_options_are_one_line_and_exit_2_before_serving(argv, message):
    done = subprocess.run([sys.executable, "-m", "cli", "mcp", *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_an_agent_reads_published_knowledge_and_never_a_draft(prefect_server, tmp_path):
    from tracking.knowledge import PUBLISHED, Entry, KnowledgeBase

    kb = KnowledgeBase(tmp_path / "knowledge")

    def add(shape_class: str, body: str) -> Entry:
        return kb.add(Entry(
            op="rmsnorm", shape_class=shape_class, gpu_class="cpu", target="tiny/bf16/d1-4/p40/c48", model="tiny",
            dtype="bf16", shapes=[f"{shape_class}_1"], score=1.2, vs_compile=None, vs_eager=1.2, gpu_timing=False,
            device="cpu", failures={"accuracy": 1}, runs=["r1"], body=body,
            winner={"candidate_id": "c1", "kind": "template", "template": "rows", "point": {"block_n": 512},
                    "source_sha256": "", "proposer": "tpe", "summary": "", "run_id": "r1"}))

    published = add("decode", "PUBLISHED: two rows a program\n")
    add("prefill", "DRAFT: not reviewed yet\n")
    kb.move(published.id, PUBLISHED, by="ada")

    async def calls(s):
        found = _data(await s.call_tool("search_knowledge", {"query": "rows", "op": "rmsnorm"}))
        return found, await s.call_tool("describe_op", {"op": "rmsnorm"})

    found, described = anyio.run(_session, tmp_path, calls)
    assert [e["id"] for e in found] == [published.id] and found[0]["text"].startswith("PUBLISHED")
    text = described.content[0].text
    assert "PUBLISHED: two rows a program" in text and "DRAFT" not in text
    # its winner is a starting point too, with the target it was measured on and its speed-up
    assert f"| {published.id} | decode_1 | pass | 1.2x |" in text and "target `tiny/bf16/d1-4/p40/c48`" in text


def test_an_fp8_targets_server_offers_and_describes_the_fp8_ops_only(tmp_path, monkeypatch):
    """Its ops are those with an fp8 target, described with their FP8 signature; another op is
    refused saying which have one."""
    from mcp.server.mcpserver.exceptions import ToolError

    from cli.mcp_server import build_server
    from gpu_pool.pool import local_pool
    from targets import Target

    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    server = build_server(Target(model="tiny", dtype="fp8"), local_pool())

    async def calls():
        listed = _data(await server.call_tool("list_ops", {}))
        described = _data(await server.call_tool("describe_op", {"op": "linear"}))
        with pytest.raises(ToolError, match="rmsnorm has no fp8 target; ops with one: fused_moe, linear"):
            await server.call_tool("describe_op", {"op": "rmsnorm"})
        return listed, described

    listed, described = anyio.run(calls)
    assert {o["op"]: o["fits_target"] for o in listed} == {"linear": True, "fused_moe": False}  # tiny is dense
    assert "weight_scale" in described


def test_a_session_budget_refuses_an_evaluate_past_it_and_tokens_are_logged_as_self_reported(prefect_server, tmp_path):
    honest = (RMS / "honest_torch.py").read_text()

    async def calls(s: ClientSession):
        first = _data(await s.call_tool("evaluate", {"op": "rmsnorm", "source": honest, "output_tokens": 700}))
        second = await s.call_tool("evaluate", {"op": "rmsnorm", "source": honest + "\n# again\n"})
        return first, second

    first, second = anyio.run(_session, tmp_path, calls, "--max-candidates", "1", "--max-gpu-hours", "5")
    assert first["status"] == "pass"
    assert second.is_error
    assert "not judged: the session's budget of 1 candidates is spent (1 judged, 0 being judged)" in \
        second.content[0].text
    tracker = Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                     artifact_root=(tmp_path / "artifacts").as_uri()))
    runs = [r for r in search(tracker, "rmsnorm") if r.data.tags.get(f"{T}kind") == "candidate"]
    [run] = runs  # the refused one never reached MLflow
    assert run.data.tags[f"{T}tokens"] == "self-reported"
    assert run.data.metrics["self_reported_tokens"] == 700 and run.data.metrics["proposer_tokens"] == 700
