"""What tracking reads back for people and flows: leaderboards chosen among the runs of one
target, dtype and GPU class before the best N are taken; kernel choices for the engine; the
optimize flow's own leaderboard artifact. A real MLflow store on SQLite throughout."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import CANDIDATES

from cli.main import main
from contract.job import Candidate
from contract.verdict import ShapeTiming, Verdict
from engine_templates.ops.rmsnorm import ROWS_TEMPLATE
from flows.optimize_op import optimize_op
from targets import Target
from tracking.history import board, kernel_choices
from tracking.ledger import Charge
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

BF16 = "qwen3-8b/bf16/d1/p2048/c4096"


def store(tmp_path, monkeypatch) -> Tracker:
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return Tracker(TrackingConfig.from_env())


def log(tracker: Tracker, cand: Candidate, score: float, target: str = BF16, gpu_class: str = "h200",
        flags: tuple[str, ...] = (), gpu_timing: bool = True) -> str:
    """A passed candidate whose one shape ran `score` times faster than eager."""
    scope = RunScope(cand.op, target.split("/")[0], target, gpu_class)
    parent = tracker.start_parent("optimization", scope, "history-test", {})
    verdict = Verdict(cand.op, cand.id, device={"gpu_timing": gpu_timing, "name": f"NVIDIA {gpu_class.upper()}"},
                      timings=[ShapeTiming("decode_b1", {}, 1.0, 1.0, score, None, roofline_us=0.5, bytes=1,
                                           flops=0)], flags=list(flags))
    run_id = tracker.open_candidate(parent, scope, cand)
    tracker.finish_candidate(run_id, cand, verdict, Charge(gpu_class=gpu_class))
    return run_id


def point(**change) -> Candidate:
    return Candidate("rmsnorm", "template", ROWS_TEMPLATE.name, ROWS_TEMPLATE.default | change)


def test_a_targets_leaderboard_is_chosen_among_its_own_runs_before_the_best_are_taken(tmp_path, monkeypatch):
    tracker = store(tmp_path, monkeypatch)
    for i in range(12):  # the same model at another dtype, all faster
        log(tracker, point(rows_per_program=[1, 2, 4][i % 3], num_warps=[1, 2, 4, 8][i // 3]), 50.0 + i,
            target="qwen3-8b/fp16/d1/p2048/c4096")
    log(tracker, point(num_warps=8), 40.0, gpu_class="h100")  # the same target on another class
    mine = point(num_warps=2)
    run_id = log(tracker, mine, 3.0)

    ranked = board(tracker, "rmsnorm", "qwen3-8b", limit=10, target=BF16, gpu_class="h200")
    assert [(e.run_id, e.target, e.rank) for e in ranked.entries] == [(run_id, BF16, 1)]
    by_dtype = board(tracker, "rmsnorm", "qwen3-8b", limit=3, dtype="fp16")
    assert [round(e.score) for e in by_dtype.entries] == [61, 60, 59]
    assert {e.target for e in board(tracker, "rmsnorm", "qwen3-8b", limit=50, dtype="bf16").entries} == {BF16}


def test_reference_fallbacks_are_counted_not_ranked(tmp_path, monkeypatch, capsys):
    """Its score is capped at 1, but its speed-ups vs eager and compile are torch's own: a board
    that ranked it would show them as a candidate's."""
    tracker = store(tmp_path, monkeypatch)
    source = (CANDIDATES / "rmsnorm" / "honest_torch.py").read_text()
    log(tracker, Candidate("rmsnorm", "free", source=source + "\n# torch's\n"), 9.0, flags=("reference_fallback",))
    real = log(tracker, point(), 0.5)
    ranked = board(tracker, "rmsnorm", "qwen3-8b", target=BF16)
    assert [e.run_id for e in ranked.entries] == [real] and ranked.fallbacks == 1

    assert main(["leaderboard", "--op", "rmsnorm"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and "rows[" in out[1] and "free:" not in "".join(out)
    assert out[2] == ("1 passed candidate flagged reference_fallback left out (PyTorch's own rmsnorm inside: "
                      "the speed is torch's)")
    assert out[3].startswith("compare the best 1 side by side in MLflow: ") and real in out[3]  # the ranked one only
    assert out[4].startswith(f"spent on {BF16} (h200): 2 candidates, ")  # the fallback cost time too


def test_kernel_choices_take_the_models_dtype_and_gpu_class_each_kernel_once(tmp_path, monkeypatch):
    tracker = store(tmp_path, monkeypatch)
    log(tracker, point(num_warps=8), 50.0, target="qwen3-8b/fp16/d1/p2048/c4096")  # another dtype
    log(tracker, point(num_warps=4), 40.0, gpu_class="h100")  # another GPU class
    log(tracker, point(num_warps=2), 30.0, gpu_timing=False)  # the interpreter's timing
    best = point(rows_per_program=2)
    log(tracker, best, 20.0)
    log(tracker, best, 19.0, target="qwen3-8b/bf16/d8/p512/c4096")  # the same kernel, another workload
    source = (CANDIDATES / "rmsnorm" / "honest_torch.py").read_text()
    free = Candidate("rmsnorm", "free", source=source)
    log(tracker, free, 10.0)
    log(tracker, Candidate("rmsnorm", "free", source=source + "\n# torch's\n"), 9.0, flags=("reference_fallback",))
    log(tracker, point(rows_per_program=4), 5.0)

    dest = tmp_path / "kernels"
    choices = kernel_choices(tracker, "qwen3-8b", "bf16", "h200", 3, dest)["rmsnorm"]
    assert choices[:2] == [{"impl": "eager"}, {"impl": "template", "template": ROWS_TEMPLATE.name, "point": best.point}]
    assert choices[2] == {"impl": "free", "path": str(dest / f"rmsnorm-{free.id}.py")}
    assert Path(choices[2]["path"]).read_text() == source  # fetched from the run's artifact
    assert choices[3] == {"impl": "template", "template": ROWS_TEMPLATE.name, "point": point(rows_per_program=4).point}
    assert len(choices) == 4


def test_optimize_leaves_the_targets_leaderboard_when_other_targets_of_the_model_score_higher(
        prefect_server, tracking_home):
    """Ten passed runs of another dtype of the same model, all scoring far higher: the flow's
    leaderboard is still that of the target it optimized."""
    tracker = Tracker(TrackingConfig.from_env())
    for i in range(10):
        log(tracker, point(block_n=[0, 256, 512, 1024, 2048][i % 5], num_warps=[1, 2][i // 5]), 1000.0 + i,
            target="tiny/bf16/d1-4/p40/c48", gpu_class="cpu", gpu_timing=False)
    target = Target(model="tiny", dtype="fp32", budget={"candidates": 1})
    result = optimize_op(op="rmsnorm", target=target, proposer="tpe", seed=3)
    assert result["passed"] == 1
    parent = tracker.client.get_run(result["parent_run_id"])
    (tracking_home / "dl").mkdir(exist_ok=True)
    path = tracker.client.download_artifacts(parent.info.run_id, "leaderboard.json", str(tracking_home / "dl"))
    rows = json.loads(Path(path).read_text())
    assert rows and all(r["target"] == target.key() for r in rows), rows


def test_opening_the_store_leaves_the_artifact_folder_where_the_home_says(tmp_path, monkeypatch):
    """The CLI opens the store before the flow resolves its own TrackingConfig: opening it must not
    turn the embedded store into what looks like a server's (MLFLOW_TRACKING_URI set), or the
    flow's artifacts would land in ./mlruns instead of INFERSMITH_HOME/artifacts."""
    from tracking.store import TrackingConfig, client

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path / "home"))
    client(TrackingConfig.from_env())
    after = TrackingConfig.from_env()
    assert after.artifact_root == (tmp_path / "home" / "artifacts").as_uri()
    assert after.uri == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
