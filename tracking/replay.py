"""A logged candidate read back whole, to be run again: its target (the parent run's
`target.json`), its candidate (point, or source from its artifacts; an engine configuration with
its free kernels' sources), the rules it was judged by (`rules.json`), the held-out shapes its
flow checked it on (the parent's `held_out.json`), its figures and the versions it ran on. reproduce and revalidate run what this returns."""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from pydantic import ValidationError

from contract.job import Candidate, Rules, Shape
from contract.serve import EngineCandidate
from targets import Target
from tracking.schema import T, Tracker

VERSIONS = ("torch", "triton", "cuda", "driver")


class NotReplayable(Exception):
    """A run id that names no candidate run that can be run again; the message is one line."""


@dataclass
class Logged:
    run: Run
    op: str  # "engine" for an engine configuration
    candidate: Candidate | EngineCandidate
    target: Target
    rules: Rules | None  # None: judged before rules were logged; the target's apply
    model_dir: str  # an engine configuration's checkpoint (a path on the pool hosts)
    command: str  # a server command judged in place of the engine (serve-bench --candidate)
    held_out: list[Shape] = field(default_factory=list)  # the held-out shapes its flow checked it on

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    @property
    def status(self) -> str:
        return self.run.data.tags.get(f"{T}status", "pending")

    @property
    def gpu_class(self) -> str:
        return self.run.data.tags.get(f"{T}gpu_class", "")

    @property
    def is_engine(self) -> bool:
        return self.op == "engine"


def versions(run: Run) -> dict[str, str]:
    """The device and software a run was measured on."""
    t = run.data.tags
    return {"device": t.get(f"{T}device", "") or "?"} | {k: t.get(f"{T}{k}", "") or "?" for k in VERSIONS}


def find_run(tracker: Tracker, run_id: str) -> Run:
    try:
        return tracker.client.get_run(run_id)
    except MlflowException:
        raise NotReplayable(f"no run {run_id} in the tracking store {tracker.cfg.uri}") from None


def logged(tracker: Tracker, run_id: str, scratch: Path) -> Logged:
    """The candidate of run `run_id`; its free sources are written under `scratch`."""
    run = find_run(tracker, run_id)
    tags = run.data.tags
    if tags.get(f"{T}kind") != "candidate" or f"{T}candidate" not in tags:
        kind = tags.get(f"{T}kind") or "not one of infersmith's"
        raise NotReplayable(f"run {run_id} is no candidate (its kind: {kind}); reproduce takes a candidate's "
                            "run id (a child run)")
    parent_id = tags.get("mlflow.parentRunId", "")
    try:
        target = Target.model_validate(_json(tracker, parent_id, "target.json", f"run {run_id}'s flow (run {parent_id})"))
    except ValidationError as e:
        err = e.errors()[0]
        raise NotReplayable(f"run {run_id}'s logged target no longer validates: {'.'.join(map(str, err['loc']))}: "
                            f"{err['msg']}") from None
    op = tags.get(f"{T}op", "")
    bare = json.loads(tags[f"{T}candidate"])
    model_dir = command = ""
    if op == "engine":
        params = tracker.client.get_run(parent_id).data.params
        model_dir, command = params.get("model_dir", ""), params.get("candidate_command", "")
        cand = EngineCandidate.from_dict(bare | {"kernels": _kernels(tracker, run_id, bare["kernels"], scratch)})
    else:
        if bare["kind"] == "free":
            bare["source"] = _text(tracker, run_id, "candidate/candidate.py", f"run {run_id}")
        cand = Candidate.from_dict(bare)
    rules = _json(tracker, run_id, "rules.json", "", required=False)
    held_out = _json(tracker, parent_id, "held_out.json", "", required=False) or []
    return Logged(run, op, cand, target, Rules(**rules) if rules else None, model_dir, command,
                  [Shape(**s) for s in held_out])


def _kernels(tracker: Tracker, run_id: str, kernels: dict, scratch: Path) -> dict:
    """The kernels mapping with each free kernel's logged source at a path under scratch."""
    out = {}
    for op, choice in kernels.items():
        if choice.get("impl") == "free":
            path = scratch / f"{op}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_text(tracker, run_id, f"kernels/{op}.py", f"run {run_id}'s free {op} kernel"))
            choice = choice | {"path": str(path)}
        out[op] = choice
    return out


def _text(tracker: Tracker, run_id: str, artifact: str, what: str) -> str:
    with tempfile.TemporaryDirectory(prefix="infersmith-replay-") as d:
        try:
            return Path(tracker.client.download_artifacts(run_id, artifact, d)).read_text()
        except (MlflowException, OSError):
            raise NotReplayable(f"{what} has no artifact {artifact}, which re-running it needs") from None


def _json(tracker: Tracker, run_id: str, artifact: str, what: str, required: bool = True):
    try:
        return json.loads(_text(tracker, run_id, artifact, what))
    except NotReplayable:
        if required:
            raise
        return None
