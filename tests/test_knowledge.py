"""The knowledge base: entries a person publishes, the TPE warm start they give another target,
and drafts that never leave it. The end-to-end test runs two optimizations on the tiny presets
under Prefect's test server, tracked in MLflow on SQLite."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CANDIDATES, last_flow_log

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401
from scripted_llm import ScriptedLLM, Turn

from cli.main import main
from engine_templates.ops.rmsnorm import ROWS_TEMPLATE
from flows.optimize_op import optimize_op
from proposers import make_proposer, warm_start_for
from proposers.base import KNOWLEDGE
from proposers.describe import describe, render
from targets import Target
from tracking.errors import KnowledgeError
from tracking.history import search as runs_of
from tracking.knowledge import DRAFT, PUBLISHED, RETIRED, Entry, KnowledgeBase, published_for, search, warm_points
from tracking.schema import RunScope, T, Tracker
from tracking.store import TrackingConfig
from tracking.trials import Trial

P1 = {"block_n": 512, "rows_per_program": 2, "num_warps": 4, "num_stages": 2}
P2 = {"block_n": 1024, "rows_per_program": 4, "num_warps": 8, "num_stages": 1}
SCOPE = RunScope("rmsnorm", "tiny-moe", "tiny-moe/fp32/d1-4/p40/c48", "cpu")


def entry(point: dict, target: str = "tiny/fp32/d1-4/p40/c48", shape_class: str = "decode",
          score: float = 1.5, cid: str = "c0ffee") -> Entry:
    model, dtype = target.split("/")[:2]
    return Entry(op="rmsnorm", shape_class=shape_class, gpu_class="cpu", target=target, model=model, dtype=dtype,
                 shapes=["decode_b1"], winner={"candidate_id": cid, "kind": "template", "template": "rows",
                                               "point": point, "source_sha256": "", "proposer": "tpe",
                                               "summary": "two rows a program", "run_id": "r1"},
                 score=score, vs_compile=None, vs_eager=score, gpu_timing=False, device="cpu",
                 failures={"accuracy": 2}, runs=["r1", "r2"], body="rows of 512, two per program\n")


def test_tpe_proposes_the_warm_points_first_then_its_default():
    tpe = make_proposer("tpe", "rmsnorm", ROWS_TEMPLATE, seed=1, warm_start=[P1, P2])
    out = tpe.propose([], 3)
    assert [c.point for c in out] == [P1, P2, ROWS_TEMPLATE.default]
    assert [c.origin for c in out] == [KNOWLEDGE, KNOWLEDGE, "tpe"]
    # stateless: a point already tried is not proposed again, the next one is
    later = tpe.propose([Trial(out[0], "pass", 1.2)], 1)
    assert [(c.point, c.origin) for c in later] == [(P2, KNOWLEDGE)]
    # random is the uniform baseline a warm start is measured against: it ignores them
    assert make_proposer("random", "rmsnorm", ROWS_TEMPLATE, warm_start=[P1]).propose([], 1)[0].point != P1


def test_only_published_entries_leave_the_knowledge_base(tmp_path):
    kb = KnowledgeBase(tmp_path / "kb")
    first = kb.add(entry(P1))
    assert first.id == "rmsnorm-decode-cpu-tiny-fp32-1" and first.state == DRAFT
    assert kb.get(first.id).text() == first.text()  # the file reads back as written
    # a draft reaches neither a prompt, a search nor a warm start
    assert published_for("rmsnorm", "cpu", kb) == [] and search("rows", kb=kb) == []
    assert warm_points("rmsnorm", "rows", SCOPE, kb) == []

    kb.move(first.id, PUBLISHED, by="ada", note="looks right")
    assert [e.id for e in published_for("rmsnorm", "cpu", kb)] == [first.id]
    assert published_for("rmsnorm", "h100", kb) == [] and published_for("silu_mul", "cpu", kb) == []
    assert [e.id for e in search("two ROWS", op="rmsnorm", kb=kb)] == [first.id]
    assert search("nothing-like-this", kb=kb) == []
    assert warm_points("rmsnorm", "rows", SCOPE, kb) == [(P1, [first.id])]
    # its own target's entry is not a warm start for that target: its runs are the history already
    own = RunScope("rmsnorm", "tiny", "tiny/fp32/d1-4/p40/c48", "cpu")
    assert warm_points("rmsnorm", "rows", own, kb) == []

    # a newer entry on the same subject, once published, retires the one before it
    second = kb.add(entry(P2))
    assert second.id == "rmsnorm-decode-cpu-tiny-fp32-2"
    changed = kb.move(second.id, PUBLISHED, by="bob")
    assert [e.id for e in changed] == [second.id, first.id]
    assert kb.get(first.id).state == RETIRED and kb.get(first.id).history[-1]["note"] == f"superseded by {second.id}"
    assert warm_points("rmsnorm", "rows", SCOPE, kb) == [(P2, [second.id])]
    with pytest.raises(KnowledgeError, match="is retired: only a draft entry can be published"):
        kb.move(first.id, PUBLISHED, by="ada")
    with pytest.raises(KnowledgeError, match="did you mean"):
        kb.get("rmsnorm-decode-cpu-tiny-fp32-9")

    exported = kb.export(tmp_path / "repo" / "knowledge")
    assert [p.name for p in exported] == [f"{second.id}.md"]
    assert exported[0].read_text().startswith("---\n") and "state: published" in exported[0].read_text()


def test_only_published_entries_reach_a_prompt(tmp_path):
    kb = KnowledgeBase(tmp_path / "kb")
    published, draft = kb.add(entry(P1)), kb.add(entry(P2, shape_class="prefill"))
    published.body, draft.body = "PUBLISHED: rows of 512\n", "DRAFT: rows of 1024\n"
    kb.save(published)
    kb.save(draft)
    kb.move(published.id, PUBLISHED, by="ada")
    bodies = [e.body for e in published_for("rmsnorm", "cpu", kb)]
    prompt = render(describe("rmsnorm", Target(model="tiny"), [], knowledge=bodies))
    assert "PUBLISHED: rows of 512" in prompt and "DRAFT" not in prompt


def test_kb_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    kb = KnowledgeBase.from_env()
    made = kb.add(entry(P1))
    assert main(["kb", "list", "--state", "draft"]) == 0
    assert made.id in capsys.readouterr().out
    assert main(["kb", "publish", made.id, "--by", "ada", "--note", "checked on two presets"]) == 0
    assert f"{made.id}: published by ada" in capsys.readouterr().out
    assert main(["kb", "show", made.id]) == 0
    shown = capsys.readouterr().out
    assert "state: published" in shown and "checked on two presets" in shown
    assert main(["kb", "publish", made.id]) == 2
    err = capsys.readouterr().err
    assert "is published: only a draft entry can be published" in err and len(err.strip().splitlines()) == 1
    assert main(["kb", "export", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / f"{made.id}.md").is_file()
    assert main(["kb", "retire", made.id, "--by", "bob"]) == 0
    assert KnowledgeBase.from_env().get(made.id).state == RETIRED
    capsys.readouterr()
    (kb.root / "hand-edited-1.md").write_text("---\nstate: published\nop: [unclosed\n---\n")
    assert main(["kb", "list"]) == 2
    err = capsys.readouterr().err
    assert "hand-edited-1.md: front matter is not YAML" in err and len(err.strip().splitlines()) == 1


def _children(tracker: Tracker, op: str, parent: str):
    runs = [r for r in runs_of(tracker, op) if r.data.tags.get("mlflow.parentRunId") == parent]
    return sorted(runs, key=lambda r: r.info.start_time)


def test_an_optimization_drafts_entries_and_published_ones_start_the_next_preset(
        prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = optimize_op(op="rmsnorm", target=Target(model="tiny", dtype="fp32", budget={"candidates": 2}),
                        proposer="random", seed=4)
    kb = KnowledgeBase.from_env()
    drafts = [kb.get(i) for i in first["drafts"]]
    # one entry per shape class the tiny workload has, each derived from both verified runs
    assert sorted(e.shape_class for e in drafts) == ["decode", "prefill"]
    tracker = Tracker(TrackingConfig.from_env())
    runs = {r.info.run_id for r in _children(tracker, "rmsnorm", first["parent_run_id"])}
    for e in drafts:
        assert e.state == DRAFT and set(e.runs) == runs and e.winner["run_id"] in runs
        assert e.target == "tiny/fp32/d1-4/p40/c48" and e.winner["kind"] == "template" and e.score > 0
        assert e.body.startswith(f"## rmsnorm, {e.shape_class} shapes")
    scope = RunScope("rmsnorm", "tiny-moe", Target(model="tiny-moe", dtype="fp32").key(), drafts[0].gpu_class)
    assert warm_points("rmsnorm", "rows", scope) == [] and published_for("rmsnorm", drafts[0].gpu_class) == []

    for e in drafts:
        assert main(["kb", "publish", e.id, "--by", "ada"]) == 0
    warm = warm_points("rmsnorm", "rows", scope)
    assert {i for _, ids in warm for i in ids} == {e.id for e in drafts}
    second = optimize_op(op="rmsnorm", target=Target(model="tiny-moe", dtype="fp32",
                                                     budget={"candidates": len(warm)}), proposer="tpe", seed=4)
    started = _children(tracker, "rmsnorm", second["parent_run_id"])
    assert [r.data.tags[f"{T}proposer"] for r in started] == [KNOWLEDGE] * len(warm)
    assert [r.data.tags[f"{T}knowledge"].split(",") for r in started] == [ids for _, ids in warm]
    assert [{k.removeprefix("point."): int(v) for k, v in r.data.params.items() if k.startswith("point.")}
            for r in started] == [p for p, _ in warm]


def free_entry(source: str, target: str, gpu_class: str = "cpu", score: float = 2.0, cid: str = "f00d") -> Entry:
    e = entry({}, target=target, shape_class="prefill", score=score)
    e.gpu_class = gpu_class
    e.winner = e.winner | {"candidate_id": cid, "kind": "free", "template": None, "source": source,
                           "source_sha256": "ab12", "proposer": "llm:coder"}
    return e


def test_the_warm_start_names_what_it_used_and_why_it_skipped_the_rest(tmp_path):
    kb = KnowledgeBase(tmp_path / "kb")
    point, own = kb.add(entry(P1)), kb.add(entry(P2, target=SCOPE.target_key, cid="bead"))
    near = kb.add(free_entry("def rmsnorm(x, weight, eps):  # near\n    return x\n", "tiny/fp32/d1-4/p40/c48"))
    far = kb.add(free_entry("def rmsnorm(x, weight, eps):  # far\n    return x\n", "qwen3-8b/bf16/d1-4/p40/c48",
                            gpu_class="h100", score=9.0, cid="beef"))
    for e in (point, own, near, far):
        kb.move(e.id, PUBLISHED, by="ada")
    assert "  # near\n" in kb.get(near.id).text()  # the source reads as code in the entry's file

    tpe = warm_start_for("tpe", "rmsnorm", "rows", SCOPE, "fp32", kb)
    assert tpe.points == [(P1, [point.id])]
    assert tpe.line() == (f"warm start: 1 point from published knowledge; used {point.id}; skipped "
                          f"{own.id} (this target's own: its runs are the history); {near.id} (free kernel: no "
                          f"template point); {far.id} (free kernel: no template point)")
    # the LLM reads the nearest kernels (its own target's too), the same GPU class before a better score
    llm = warm_start_for("llm", "rmsnorm", "rows", SCOPE, "fp32", kb)
    assert [[e.id for e in g] for g in llm.kernels] == [[own.id], [near.id], [point.id]]
    assert llm.skipped == [(far.id, "farther than the 3 nearest kernels")]
    prompt = render(describe("rmsnorm", Target(model="tiny-moe", dtype="fp32"), [], kernels=llm.kernels))
    assert "  # near\n" in prompt and "  # far" not in prompt
    assert f"| {near.id} | decode_b1 | pass | 2x |" in prompt and "measured on target `tiny/fp32/d1-4/p40/c48`" in prompt
    assert warm_start_for("random", "rmsnorm", "rows", SCOPE, "fp32", kb).line() == \
        "warm start: off (random is the uniform baseline: it starts cold)"
    assert warm_start_for("tpe", "silu_mul", "rows", SCOPE, "fp32", kb).line() == \
        "warm start: none (no published knowledge of silu_mul)"


def test_a_published_free_kernel_reaches_the_next_llm_run_first_prompt(prefect_server, tmp_path, monkeypatch,
                                                                        capsys):
    """An LLM's winning module, published, is in the first request an LLM run on another preset
    sends, with the target it was measured on and its speed-up; a TPE run says it skipped it."""
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("INFERSMITH_TEST_LLM_KEY", "sk-test-knowledge")
    module = (CANDIDATES / "rmsnorm" / "honest_torch.py").read_text().replace("import torch",
                                                                               "import torch  # the published one")

    def optimize(model: str, *argv: str) -> tuple[str, list[dict]]:
        with ScriptedLLM([Turn(f"Here it is.\n\n```python\n{module}```\n", 900, 0, 100)]) as llm:
            code = main(["optimize", "--op", "rmsnorm", "--model", model, "--dtype", "fp32", "--budget", "1",
                         "--proposer", "llm", "--llm-provider", "openai", "--llm-model", "scripted-coder",
                         "--llm-base-url", llm.url + "/v1", "--llm-api-key-env", "INFERSMITH_TEST_LLM_KEY",
                         "--llm-max-retries", "0", "--llm-timeout", "30", *argv] if argv != ("tpe",) else
                        ["optimize", "--op", "rmsnorm", "--model", model, "--dtype", "fp32", "--budget", "1"])
            assert code == 0, capsys.readouterr()
            return last_flow_log(), llm.requests

    out, _ = optimize("tiny")
    assert "warm start: none (no published knowledge of rmsnorm)" in out
    kb = KnowledgeBase.from_env()
    drafts = kb.entries(DRAFT, "rmsnorm")
    assert drafts and all(e.winner["kind"] == "free" and e.winner["source"] == module for e in drafts)
    for e in drafts:
        kb.move(e.id, PUBLISHED, by="ada")

    out, requests = optimize("tiny-moe")
    ids = sorted(e.id for e in drafts)
    used = next(x for x in out.splitlines() if x.startswith("warm start:"))
    assert used.startswith("warm start: 1 kernel from published knowledge; used "), used
    assert sorted(used.split("; used ")[1].split(", ")) == ids, used  # best score first: either order
    first = requests[0]["body"]["messages"][1]["content"]
    assert "## Published kernels" in first and module.strip() in first
    assert "measured on target `tiny/fp32/d1-4/p40/c48`" in first
    for e in drafts:
        assert f"| {e.id} | {', '.join(e.shapes)} | pass | {e.score:.3g}x |" in first

    out, _ = optimize("tiny-moe", "tpe")
    line = next(x for x in out.splitlines() if x.startswith("warm start:"))
    assert all(f"{i} (free kernel: no template point)" in line for i in ids), line


def linear_entry(point: dict, shape_class: str, cid: str) -> Entry:
    e = entry(point, shape_class=shape_class, cid=cid)
    e.op, e.winner = "linear", e.winner | {"template": "tiles"}
    return e


VISION = RunScope("layernorm", "sam3-tiny", Target(model="sam3-tiny", dtype="fp32").key(), "cpu")


def test_a_vision_op_starts_from_the_text_ops_points_that_fit_its_space(tmp_path):
    kb = KnowledgeBase(tmp_path / "kb")
    fits = kb.add(entry(P1))
    auto = kb.add(entry(P1 | {"num_warps": 0}, shape_class="prefill", cid="a0"))  # rmsnorm's "from the row width"
    tiles = {"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 4, "num_warps": 8, "num_stages": 3}
    linear = kb.add(linear_entry(tiles, "decode", "11"))
    small = kb.add(linear_entry(tiles | {"block_m": 16}, "prefill", "12"))  # linear's decode tile: too small here
    for e in (fits, auto, linear, small):
        kb.move(e.id, PUBLISHED, by="ada")

    warm = warm_start_for("tpe", "layernorm", "rows", VISION, "fp32", kb)
    assert warm.points == [(P1, [fits.id])]
    assert warm.skipped == [(auto.id, "num_warps=0 outside layernorm/rows's space")]
    linear_warm = warm_start_for("tpe", "vision_linear", "tiles", VISION, "fp32", kb)
    assert linear_warm.points == [(tiles, [linear.id])]
    assert linear_warm.skipped == [(small.id, "block_m=16 outside vision_linear/tiles's space")]
    # a text op's search takes its own points alone, num_warps=0 too; the carry-over runs one way
    text = warm_start_for("tpe", "rmsnorm", "rows", SCOPE, "fp32", kb)
    assert sorted(i for _, ids in text.points for i in ids) == sorted([fits.id, auto.id]) and not text.skipped
    assert warm_start_for("tpe", "gelu", "flat", VISION, "fp32", kb).line() == \
        "warm start: none (no published knowledge of gelu)"


def test_a_layernorm_search_on_sam3_starts_from_a_published_rmsnorm_point(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kb = KnowledgeBase.from_env()
    published = kb.add(entry(P2))
    kb.move(published.id, PUBLISHED, by="ada")
    result = optimize_op(op="layernorm", target=Target(model="sam3-tiny", dtype="fp32", budget={"candidates": 1}),
                         proposer="tpe", seed=0)
    tracker = Tracker(TrackingConfig.from_env())
    [started] = _children(tracker, "layernorm", result["parent_run_id"])
    assert started.data.tags[f"{T}proposer"] == KNOWLEDGE and started.data.tags[f"{T}knowledge"] == published.id
    assert {k.removeprefix("point."): int(v) for k, v in started.data.params.items() if k.startswith("point.")} == P2
    logged = tracker.client.download_artifacts(result["parent_run_id"], "knowledge.json", str(tmp_path / "dl"))
    assert json.loads(Path(logged).read_text())["warm_start"]["used"] == [published.id]
