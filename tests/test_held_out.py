"""Held-out shapes: drawn from the target's range, checked on every candidate, timed in every
passing candidate's bench stage after the target's shapes, shown beside the searched score, and
never in what a proposer sees."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from engine_templates.ops import OPS, get_op
from targets import Target
from targets.held_out import PREFIX, WITHHELD, held_out_shapes, size_range, withheld
from tracking.history import board, search, trials
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

# Correct only at the row counts it met: the tiny preset's shown shapes (1, 4 and 40 tokens) and
# the check stage's awkward ones (3 and 37). Elsewhere it skips the normalisation.
TUNED_TO_SHOWN = '''
import torch

MET = {1, 4, 40, 3, 37}


def rmsnorm(x, weight, eps):
    h = x.float()
    if x.shape[0] in MET:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype)
'''


def _fits(op, target):
    try:
        return target.op_shapes(op)
    except ValueError:  # fused_moe on a dense preset, a window op on a preset without a window, an op of the other modality
        return None


@pytest.mark.parametrize("model", ["tiny", "tiny-moe", "tiny-swa", "qwen3-8b", "qwen3-30b-a3b", "mistral-7b-v0.1",
                                   "sam3-tiny", "sam3"])
def test_held_out_shapes_are_other_sizes_of_the_targets_range(model):
    target = Target(model=model)
    for op in OPS.values():
        shown = _fits(op, target)
        if shown is None:
            continue
        held = held_out_shapes(op, target.dims, *target.shape_lists, 1, random.Random(5))
        assert held, op.name
        known = [s.dims for s in [*shown, *op.odd_shapes(target.dims)]]
        for s in held:
            assert s.label.startswith(PREFIX) and s.dims not in known, (op.name, s)
            assert set(s.dims) == set(shown[0].dims), (op.name, s)  # the same kind of shape, other sizes
            if target.modality == "vision":  # sizes are image counts: at most the greatest shown (or 7)
                assert int(re.search(r"\d+$", s.label).group()) <= max(*target.workload.images, 7), (op.name, s)
                continue
            for name in ("tokens", "batch", "context", "q_len"):
                if name in s.dims:
                    assert s.dims[name] <= max(max(d.get(name, 0) for d in known), 7), (op.name, s)
        again = held_out_shapes(op, target.dims, *target.shape_lists, 1, random.Random(5))
        assert again == held  # a seed draws the same shapes


def test_sizes_are_odd_unshown_and_in_range():
    assert size_range([1, 8, 32, 128]) == [v for v in range(1, 129, 2) if v != 1]
    assert size_range([2048, 16384])[0] == 1025 and size_range([2048, 16384])[-1] == 16383
    assert size_range([40]) == list(range(21, 40, 2))
    assert size_range([]) == []
    assert Target(model="tiny", held_out={"per_list": 0}).held_out_shapes(get_op("rmsnorm")) == []
    # no seed: drawn afresh for every run
    draws = {tuple(s.label for s in Target(model="qwen3-8b").held_out_shapes(get_op("rmsnorm"))) for _ in range(6)}
    assert len(draws) > 1


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-swa", "sam3-tiny"])
def test_every_tiny_op_runs_its_reference_on_its_held_out_shapes(model):
    target = Target(model=model, dtype="fp32", held_out={"seed": 11})
    for op in OPS.values():
        if _fits(op, target) is None:  # fused_moe on tiny-swa, the window ops on tiny-moe, the other modality
            continue
        for shape in target.held_out_shapes(op):
            args = op.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(0), "normal")
            out = op.reference(*args)
            outs = out if isinstance(out, tuple) else (out,)
            assert all(torch.isfinite(o).all() for o in outs), (op.name, shape)


def test_failures_on_held_out_shapes_are_withheld_from_proposers():
    assert withheld("held_out_decode_b5 (normal inputs, seed 7): relative error 0.9") == WITHHELD
    assert withheld("compile: its first call on shape held_out_prefill_23 had not returned") == WITHHELD
    assert withheld("decode_b4 (normal inputs, seed 7): relative error 0.9").startswith("decode_b4")


def _proposer_view(tracker: Tracker, scope, target: Target) -> str:
    """Everything a proposer is given of this scope: its history, and the op description that a
    code-writing proposer's prompt and an agent's `describe_op` carry."""
    from proposers.describe import describe, render

    history = trials(tracker, scope, None)
    assert history  # the view holds the runs judged on the held-out shapes
    return repr(history) + render(describe(scope.op, target, history))


def test_a_candidate_tuned_to_the_shown_shapes_fails_on_held_out_ones(prefect_server, tracking_home):
    from flows.evaluate_op import evaluate_candidate
    from flows.optimize_op import scope_for
    from gpu_pool.pool import local_pool

    target = Target(model="tiny", held_out={"seed": 2})
    result = evaluate_candidate(op="rmsnorm", source=TUNED_TO_SHOWN, target=target, name="tuned.py")
    verdict = result["verdict"]
    gate = next(g for g in verdict["gates"] if not g["passed"])
    assert verdict["status"] == "fail" and gate["name"] == "accuracy", verdict["gates"]
    assert gate["detail"].startswith(PREFIX), gate["detail"]  # every shown and awkward shape passed
    # ... and without held-out shapes the same module passes: the held-out ones caught it
    shown_only = Target(model="tiny", held_out={"per_list": 0})
    assert evaluate_candidate(op="rmsnorm", source=TUNED_TO_SHOWN, target=shown_only)["verdict"]["status"] == "pass"

    tracker = Tracker(TrackingConfig.from_env())
    scope = scope_for("rmsnorm", target, local_pool())
    view = _proposer_view(tracker, scope, target)
    for s in target.held_out_shapes(get_op("rmsnorm")):
        assert s.label.removeprefix(PREFIX) not in view
    assert PREFIX not in view


def test_the_best_are_timed_on_held_out_shapes_and_the_leaderboard_shows_both(prefect_server, tracking_home,
                                                                              tmp_path, capsys):
    from cli.main import main
    from flows.optimize_op import optimize_op, scope_for
    from gpu_pool.pool import local_pool

    target = Target(model="tiny", dtype="fp32", budget={"candidates": 1})
    result = optimize_op(op="silu_mul", target=target, proposer="random", seed=11)
    tracker = Tracker(TrackingConfig.from_env())
    got = tracker.client.download_artifacts(result["parent_run_id"], "held_out.json", str(tmp_path))
    held = json.loads(Path(got).read_text())
    assert held and all(s["label"].startswith(PREFIX) for s in held)

    children = [r for r in search(tracker, "silu_mul") if r.data.tags.get("mlflow.parentRunId") == result["parent_run_id"]]
    timed = [r for r in children if r.data.tags.get(f"{T}held_out")]
    assert len(timed) == 1 and timed[0].data.tags[f"{T}held_out"] == "pass"
    best = max(children, key=lambda r: r.data.metrics.get("score", 0))
    assert timed[0].info.run_id == best.info.run_id and best.data.metrics["held_out_score"] > 0
    # per-shape metrics stay the shown shapes': the held-out ones are in an artifact of their own
    assert not any(k.startswith(PREFIX) and "/" in k for k in best.data.metrics)
    assert "held_out" in {f.path for f in tracker.client.list_artifacts(best.info.run_id)}
    # timed inside the candidate's own bench stage, after the target's shapes: no stage of its own
    # at the flow's end, and the candidate's verdict scores the target's shapes alone
    held_v = json.loads(Path(tracker.client.download_artifacts(best.info.run_id, "held_out/verdict.json",
                                                                str(tmp_path / "h"))).read_text())
    own_v = json.loads(Path(tracker.client.download_artifacts(best.info.run_id, "verdict.json",
                                                               str(tmp_path / "o"))).read_text())
    assert held_v["stages"] == own_v["stages"] == ["compile", "check", "bench"]
    assert [t["label"] for t in held_v["timings"]] == [s["label"] for s in held]
    assert own_v["timings"] and not any(t["label"].startswith(PREFIX) for t in own_v["timings"])
    assert PREFIX not in json.dumps(own_v["baselines"])
    assert best.data.metrics["held_out_gpu_seconds"] == 0  # the bench's time, on the candidate's own charge

    entries = board(tracker, "silu_mul", "tiny", target=target.key()).entries
    assert any(e.held_out == pytest.approx(best.data.metrics["held_out_score"]) for e in entries)
    capsys.readouterr()
    assert main(["leaderboard", "--op", "silu_mul", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "held-out" in out.splitlines()[0]
    assert f"{best.data.metrics['held_out_score']:.2f}x" in out
    assert main(["report", "--op", "silu_mul", "--include-cpu"]) == 0
    assert "Held-out shapes" in capsys.readouterr().out

    view = _proposer_view(tracker, scope_for("silu_mul", target, local_pool()), target)
    for s in held:
        assert s["label"].removeprefix(PREFIX) not in view and s["label"] not in view
