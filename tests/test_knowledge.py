"""The knowledge base: entries a person publishes, the TPE warm start they give another target,
and drafts that never leave it. The end-to-end test runs two optimizations on the tiny presets
under Prefect's test server, tracked in MLflow on SQLite."""
from __future__ import annotations

import pytest

from cli.main import main
from engine_templates.ops.rmsnorm import ROWS_TEMPLATE
from flows.optimize_op import optimize_op
from proposers import make_proposer
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
          score: float = 1.5) -> Entry:
    model, dtype = target.split("/")[:2]
    return Entry(op="rmsnorm", shape_class=shape_class, gpu_class="cpu", target=target, model=model, dtype=dtype,
                 shapes=["decode_b1"], winner={"candidate_id": "c0ffee", "kind": "template", "template": "rows",
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
