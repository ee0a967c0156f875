"""The one tracking schema: every optimization a parent run, every candidate a child run.

Parent run (tag infersmith.kind = optimization | evaluation): the target and proposer as
params; totals (candidates, passed, best score, GPU-seconds, dollars, tokens) as metrics.
Child run (infersmith.kind = candidate): the candidate's point or source hash as params;
the verdict's metrics (per shape `<shape>/<metric>`, plus score, geomean speed-ups,
relative error), the GPU's measured ceilings and the ledger (GPU-seconds, cost, proposer
tokens and dollars) as metrics; status, op, target, model, proposer, GPU, failing gate and its
detail, screening flags as tags; the candidate's source, its verdict and (from an LLM) the
prompt and reply as artifacts.
A passed child, whose bench stage timed the held-out shapes too, gets `held_out_*`
summary metrics, tags `held_out` and `held_out_gate`, and `held_out/verdict.json`.
A child is created `pending` when proposed, so parallel proposers see it in flight; a
pending child whose parent's controller is gone is an orphan, re-queued by the next flow.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from contract.job import Candidate, Rules
from contract.serve import EngineCandidate
from contract.verdict import CRASH, Verdict
from tracking.ledger import Charge
from tracking.store import TrackingConfig, client, experiment_id

if TYPE_CHECKING:
    from targets import Target

PENDING = "pending"
T = "infersmith."  # tag prefix
MAX_PARAM = 500
_SOURCES: dict[str, str] = {}  # free candidates' sources by run id, as downloaded
MAX_DETAIL = 1000  # of a failing gate's detail kept as a tag; verdict.json holds all of it
# The ceilings a GPU-timed verdict measured (keyed by its device["ceilings"] names), as metrics:
# where the controller learns a GPU class's roofline (tracking.history.ceilings) without a worker.
CEILING_METRICS = {"copy_bytes_per_s": "ceiling_copy_bytes_per_s", "matmul_flops_per_s": "ceiling_matmul_flops_per_s"}
# The verdict's summaries kept, prefixed `held_out_`, from a timing on the held-out shapes.
HELD_OUT_SUMMARY = ("score", "geomean_speedup_vs_eager", "geomean_speedup_vs_compile", "geomean_pct_roofline")


def _flatten(prefix: str, obj, out: dict[str, str]) -> dict[str, str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = json.dumps(obj) if isinstance(obj, list) else str(obj)
    return out


def _batch(c: MlflowClient, run_id: str, metrics=None, params=None, tags=None) -> None:
    now = int(time.time() * 1000)
    c.log_batch(run_id,
                metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()],
                params=[Param(k, str(v)[:MAX_PARAM]) for k, v in (params or {}).items()],
                tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])


@dataclass(frozen=True)
class RunScope:
    """What a set of runs is about: comparable runs share all of it."""

    op: str
    model: str
    target_key: str
    gpu_class: str

    @classmethod
    def on(cls, op: str, target: Target, slots: list) -> RunScope:
        """The scope of the op's runs for the target on these slots (a pool's, gpu_pool.pool.Slot):
        their GPU class, or "mixed"."""
        classes = {s.host.gpu_class for s in slots}
        if not classes:
            raise ValueError(f"the pool has no host of GPU class {target.gpu_class!r}")
        return cls(op, target.model, target.key(), classes.pop() if len(classes) == 1 else "mixed")


class Tracker:
    def __init__(self, cfg: TrackingConfig):
        self.cfg = cfg
        self.client = client(cfg)

    def experiment(self, op: str) -> str:
        return experiment_id(self.client, self.cfg, op)

    # -- parent ------------------------------------------------------------------
    def start_parent(self, kind: str, scope: RunScope, name: str, params: dict, tags: dict | None = None) -> str:
        run = self.client.create_run(self.experiment(scope.op), run_name=name, tags={
            f"{T}kind": kind, f"{T}op": scope.op, f"{T}model": scope.model,
            f"{T}target": scope.target_key, f"{T}gpu_class": scope.gpu_class,
            f"{T}controller": controller_id(), **(tags or {})})
        _batch(self.client, run.info.run_id, params=_flatten("", params, {}))
        if "target" in params:  # whole, as JSON: what reproduce and revalidate rebuild the target from
            self.client.log_dict(run.info.run_id, params["target"], "target.json")
        return run.info.run_id

    def finish_parent(self, run_id: str, metrics: dict[str, float], artifacts: dict[str, object]) -> None:
        _batch(self.client, run_id, metrics=metrics)
        for path, obj in artifacts.items():
            self.client.log_dict(run_id, obj, path)
        self.client.set_terminated(run_id, "FINISHED")

    def fail_parent(self, run_id: str, reason: str) -> None:
        self.client.set_tag(run_id, f"{T}error", reason[:4000])
        self.client.set_terminated(run_id, "FAILED")

    # -- children ----------------------------------------------------------------
    def open_candidate(self, parent_id: str, scope: RunScope, cand: Candidate, requeued_from: str = "",
                       extra_tags: dict[str, str] | None = None, reruns: str = "") -> str:
        """A pending child run; `extra_tags` (without the infersmith. prefix) are added to it;
        `reruns`: the run this one re-runs (reproduce, revalidate)."""
        source_sha = hashlib.sha256((cand.source or "").encode()).hexdigest()[:16] if cand.source else ""
        bare = {k: v for k, v in cand.to_dict().items() if k != "source"}
        tags = {"mlflow.parentRunId": parent_id, f"{T}kind": "candidate", f"{T}op": scope.op,
                f"{T}model": scope.model, f"{T}target": scope.target_key, f"{T}status": PENDING,
                f"{T}candidate_id": cand.id, f"{T}candidate": json.dumps(bare, sort_keys=True),
                f"{T}proposer": cand.origin, f"{T}template": cand.template or "free",
                # pool_class is the scope the proposer's history is read by; gpu_class becomes the
                # class of the slot that ran it, which in a mixed pool differs.
                f"{T}pool_class": scope.gpu_class, f"{T}gpu_class": scope.gpu_class} | (
                    {f"{T}requeued_from": requeued_from} if requeued_from else {}) | (
                    {f"{T}reruns": reruns} if reruns else {})
        run = self.client.create_run(self.experiment(scope.op), run_name=cand.label, tags=tags | {
            f"{T}{k}": v for k, v in (extra_tags or {}).items()})
        params = {"candidate.kind": cand.kind, "candidate.id": cand.id}
        if cand.kind == "template":
            params["candidate.template"] = cand.template
            params.update({f"point.{k}": v for k, v in cand.point.items()})
        else:
            params["candidate.source_sha256"] = source_sha
        _batch(self.client, run.info.run_id, params=params)
        if cand.source is not None:  # now, not when judged: a pending run is read back as a trial
            self.client.log_text(run.info.run_id, cand.source, "candidate/candidate.py")
        return run.info.run_id

    def log_proposal(self, run_id: str, charge: Charge, prompt: str, reply: str, about: dict) -> None:
        """What proposing a candidate cost, on its run as soon as the reply is in, and the
        transcript: the prompt as sent and the reply as received."""
        _batch(self.client, run_id, metrics=charge.token_metrics())
        self.client.log_text(run_id, prompt, "proposal/prompt.md")
        self.client.log_text(run_id, reply, "proposal/reply.md")
        self.client.log_dict(run_id, about, "proposal/about.json")

    def finish_candidate(self, run_id: str, cand: Candidate, verdict: Verdict, charge: Charge,
                         template_source: str | None = None, tags: dict[str, str] | None = None,
                         rules: Rules | None = None) -> None:
        """`rules`: those it was judged by (None when no slot was reached), as `rules.json`."""
        _batch(self.client, run_id, metrics={**verdict.metrics(), **charge.metrics(), **_ceilings(verdict)},
               tags=_finish_tags(verdict, charge) | {f"{T}{k}": v for k, v in (tags or {}).items()})
        if rules is not None:
            self.client.log_dict(run_id, asdict(rules), "rules.json")
        if template_source is not None:
            self.client.log_text(run_id, template_source, f"candidate/{cand.template}.py")
            self.client.log_dict(run_id, cand.point, "candidate/point.json")
        self.client.log_text(run_id, verdict.to_json(), "verdict.json")
        self.client.set_terminated(run_id, "FAILED" if verdict.status == CRASH else "FINISHED")

    def free_source(self, run_id: str) -> str | None:
        """The module a free candidate's run holds (its tag holds none), or None where it holds none.
        A logged source never changes, so each is downloaded once per process."""
        if run_id not in _SOURCES:
            with tempfile.TemporaryDirectory() as d:
                try:
                    path = self.client.download_artifacts(run_id, "candidate/candidate.py", d)
                except (OSError, MlflowException):
                    return None
                _SOURCES[run_id] = Path(path).read_text()
        return _SOURCES[run_id]

    def finish_held_out(self, run_id: str, verdict: Verdict, charge: Charge) -> None:
        """A passed candidate's timing on the held-out shapes, on its own run beside its searched
        figures: `held_out_score` and the geomeans under `held_out_`, its status and failing gate
        as tags, the verdict as `held_out/verdict.json`. Per-shape figures stay in that artifact:
        the run's `<shape>/<metric>` metrics are the shown shapes' alone."""
        failing = verdict.failing_gate
        m = verdict.metrics()
        metrics = {f"held_out_{k}": m[k] for k in HELD_OUT_SUMMARY if k in m}
        metrics |= {"held_out_gpu_seconds": charge.gpu_seconds, "held_out_cost_usd": charge.usd}
        _batch(self.client, run_id, metrics=metrics,
               tags={f"{T}held_out": verdict.status, f"{T}held_out_gate": failing.name if failing else ""})
        self.client.log_text(run_id, verdict.to_json(), "held_out/verdict.json")

    def decide_candidate(self, run_id: str, verdict: Verdict, outcome: str, by: str, at: str, note: str) -> None:
        """A person's decision on a candidate that waited for approval: its final verdict (a
        score only when approved), the decision, who made it and when."""
        failing = verdict.failing_gate
        _batch(self.client, run_id, metrics=verdict.metrics(), tags={
            f"{T}status": verdict.status, f"{T}failing_gate": failing.name if failing else "",
            f"{T}approval": outcome, f"{T}approval_by": by, f"{T}approval_at": at, f"{T}approval_note": note})
        self.client.log_text(run_id, verdict.to_json(), "verdict.json")

    # -- engine configurations (the end-to-end stage) ------------------------------
    def open_engine_candidate(self, parent_id: str, scope: RunScope, cand: EngineCandidate, reruns: str = "") -> str:
        """A pending child run; a free kernel's source as `kernels/<op>.py` (its path is a scratch
        file the flow removes), so that the configuration can be re-run. A spec file's
        configuration: `knob.<name>` params and its command line as `command.txt` (the exact one
        each server ran, port filled in, is `serve/server.command`)."""
        tags = {"mlflow.parentRunId": parent_id, f"{T}kind": "candidate", f"{T}op": scope.op,
                f"{T}model": scope.model, f"{T}target": scope.target_key, f"{T}status": PENDING,
                f"{T}candidate_id": cand.id, f"{T}candidate": json.dumps(cand.to_dict(), sort_keys=True),
                f"{T}proposer": cand.origin, f"{T}template": "engine", f"{T}pool_class": scope.gpu_class,
                f"{T}gpu_class": scope.gpu_class} | ({f"{T}reruns": reruns} if reruns else {})
        run = self.client.create_run(self.experiment(scope.op), run_name=cand.label, tags=tags)
        if cand.engine:  # an engine spec file's configuration: its knobs, and the command they make
            params = {"candidate.id": cand.id, "engine": cand.engine,
                      **{f"knob.{k}": json.dumps(v) if isinstance(v, bool) else v for k, v in cand.settings.items()}}
            _batch(self.client, run.info.run_id, params=params)
            self.client.log_text(run.info.run_id, cand.command + "\n", "command.txt")
            return run.info.run_id
        params = {"candidate.id": cand.id, "engine.block_size": cand.block_size,
                  "engine.max_num_seqs": cand.max_num_seqs,
                  "engine.max_num_batched_tokens": cand.max_num_batched_tokens,
                  "engine.cuda_graph_max_batch": cand.cuda_graph_max_batch}
        params |= {f"kernel.{op}": c.get("template") or c["impl"] for op, c in cand.kernels.items()}
        _batch(self.client, run.info.run_id, params=params)
        for op, c in cand.kernels.items():
            if c.get("impl") == "free" and Path(c["path"]).is_file():
                self.client.log_text(run.info.run_id, Path(c["path"]).read_text(), f"kernels/{op}.py")
        return run.info.run_id

    def open_image_candidate(self, parent_id: str, scope: RunScope, cand_id: str, label: str,
                             kernels: str | None) -> str:
        """A pending child run of the image stage (SAM 3's engine, docs/images.md): the kernels
        file the engine ran with as `kernels.json` (none: every op eager)."""
        tags = {"mlflow.parentRunId": parent_id, f"{T}kind": "candidate", f"{T}op": scope.op,
                f"{T}model": scope.model, f"{T}target": scope.target_key, f"{T}status": PENDING,
                f"{T}candidate_id": cand_id, f"{T}proposer": "serve-bench", f"{T}template": "engine-images",
                f"{T}pool_class": scope.gpu_class, f"{T}gpu_class": scope.gpu_class}
        run = self.client.create_run(self.experiment(scope.op), run_name=label, tags=tags)
        _batch(self.client, run.info.run_id, params={"candidate.id": cand_id, "modality": "vision",
                                                     "kernels": "eager" if kernels is None else "file"})
        if kernels is not None:
            self.client.log_text(run.info.run_id, kernels, "kernels.json")
        return run.info.run_id

    def finish_engine_candidate(self, run_id: str, verdict: Verdict, metrics: dict[str, float], charge: Charge,
                                artifacts: Path | None) -> None:
        """Per-pattern metrics `<pattern>/<metric>` beside the baseline's; AIPerf's exports, the
        server's log and the kernels file as artifacts, whatever the verdict."""
        _batch(self.client, run_id, metrics={**metrics, **charge.metrics(), "serve_wall_s": verdict.wall_s},
               tags=_finish_tags(verdict, charge))
        if artifacts is not None and artifacts.is_dir():
            self.client.log_artifacts(run_id, str(artifacts), "serve")
        self.client.log_text(run_id, verdict.to_json(), "verdict.json")
        self.client.set_terminated(run_id, "FAILED" if verdict.status == CRASH else "FINISHED")

    # -- orphans -----------------------------------------------------------------
    def orphaned_pending(self, scope: RunScope, template: str) -> list[tuple[str, Candidate]]:
        """Pending children of this scope whose flow is gone: its parent run ended, or its
        controller process on this machine died (a killed flow never ends its runs)."""
        where = " AND ".join(f"tags.`{T}{k}` = '{v}'" for k, v in {
            "kind": "candidate", "op": scope.op, "target": scope.target_key, "template": template,
            "pool_class": scope.gpu_class, "status": PENDING}.items())
        runs = self.client.search_runs([self.experiment(scope.op)], where, max_results=1000)
        parents: dict[str, bool] = {}
        out = []
        for run in runs:
            parent_id = run.data.tags.get("mlflow.parentRunId", "")
            if parent_id not in parents:
                parent = self.client.get_run(parent_id)
                parents[parent_id] = (parent.info.status != "RUNNING"
                                      or not controller_alive(parent.data.tags.get(f"{T}controller", "")))
            if parents[parent_id]:
                bare = json.loads(run.data.tags[f"{T}candidate"])
                if bare["kind"] == "free":
                    bare["source"] = self.free_source(run.info.run_id)
                    if bare["source"] is None:  # opened by a version that logged no source when pending
                        continue
                out.append((run.info.run_id, Candidate.from_dict(bare)))
        return out

    def retire_orphan(self, run_id: str, requeued_to: str) -> None:
        """The orphan's candidate now runs as `requeued_to`; the orphan leaves the active runs."""
        self.client.set_tag(run_id, f"{T}requeued_to", requeued_to)
        self.client.set_terminated(run_id, "KILLED")
        self.client.delete_run(run_id)


def _ceilings(verdict: Verdict) -> dict[str, float]:
    ceil = verdict.device.get("ceilings") or {}
    if not verdict.gpu_timing or not all(isinstance(ceil.get(k), (int, float)) for k in CEILING_METRICS):
        return {}
    return {name: float(ceil[k]) for k, name in CEILING_METRICS.items()}


def _finish_tags(verdict: Verdict, charge: Charge) -> dict[str, str]:
    failing = verdict.failing_gate
    return {f"{T}status": verdict.status, f"{T}failing_gate": failing.name if failing else "",
            f"{T}failing_detail": failing.detail[:MAX_DETAIL] if failing else "",
            f"{T}host": charge.host, f"{T}gpu": charge.gpu, f"{T}gpu_class": charge.gpu_class,
            f"{T}gpu_index": "" if charge.gpu_index is None else str(charge.gpu_index),
            f"{T}held": json.dumps(charge.held),
            f"{T}device": verdict.device.get("name", ""),
            **{f"{T}{k}": verdict.device.get(k) or "" for k in ("torch", "triton", "cuda", "driver")},
            f"{T}gpu_timing": str(verdict.gpu_timing).lower(), f"{T}tokens": charge.token_source,
            # screening findings (reference_fallback, reduced_precision, side_stream, ...): a
            # reader of the per-shape speed-ups must see that a reference_fallback's are torch's
            f"{T}flags": ",".join(sorted(verdict.flags))}


def _start_ticks(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is told apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def controller_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid())}"


def controller_alive(controller: str) -> bool:
    """False only when the controller ran on this machine and its process is gone; a
    controller on another machine is assumed alive (this machine cannot see it)."""
    host, _, rest = controller.partition(":")
    pid, _, ticks = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not ticks or _start_ticks(int(pid)) == ticks
