"""The serve stage's worker side on a pool host: the servers start and AIPerf loads them on the
host itself (they bind loopback there, and a load generator across the network would measure
the network). The controller (gpu_pool/ssh_serve.py) ships a session's job, runs it here, and
fetches `out/` and `result.json` back.

    python -m harness.serve check MODEL_DIR [--baseline vllm|sglang]
                                                  what this host lacks to serve MODEL_DIR (and to run
                                                  that baseline engine), one line each
    python -m harness.serve run JOB.json RUN_DIR  one session: reference, baseline or candidate
    python -m harness.serve check MODEL_DIR --images, run-images JOB.json RUN_DIR
                                                  the same for the image stage (remote_images.py)
    python -m harness.serve kill MARKER           every process of a session, whatever its group

RUN_DIR: `out/` (the artifacts, fetched and logged: server.log, or server-<i>.log and balancer.log
with several replicas; kernels; AIPerf exports), `exchange/` (the accuracy handshake: every
replica's completions at once before load, `completions.json`, then those sent under each
pattern's load, `under-load-<pattern>.json`; each answered by the controller in a decision file),
`result.json`, and for the reference `answers.json`, which
the controller reads into memory and never stores. The whole folder is removed after the session.

Trust: a candidate server runs here as the same user, so nothing it could read may tell it the
expected answers. The reference's answers leave with the controller before any candidate starts;
a candidate session gets the prompts only (the held-out ones are unavoidably sent) and hands its
completions to the controller, which judges them and answers only whether to go on (to the load,
to the next pattern). Each pattern's fresh prompt (harness/serve/under_load.py) comes with the
answer that lets the session go on to that pattern, not before: until then no file here holds it,
and the session removes that answer as soon as it has read it (within a poll of 0.1 s). A server
that watched the exchange folder that closely, or read this process's memory, could still see it
first: the same user shares what it can read.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from contract.serve import AccuracyRules, Completion, EngineCandidate, Pattern, Reference, ServeJob, ServerError
from harness.serve import aiperf
from harness.serve.baselines import ENGINES
from harness.serve.baselines import missing as engine_missing
from harness.serve.stage import measure_baseline, reference_answers, serve

MARKER_VAR = "INFERSMITH_SERVE_SESSION"  # inherited by every process a session starts: how `kill` finds them
DECISION_WAIT_S = 120.0  # the controller answers within a poll; longer means it is gone


# -- what crosses the wire ------------------------------------------------------
def job_to_dict(job: ServeJob) -> dict:
    reference = None if job.reference_model_dir is None else str(job.reference_model_dir)
    return asdict(job) | {"model_dir": str(job.model_dir), "reference_model_dir": reference}


def job_from_dict(d: dict) -> ServeJob:
    reference = d.get("reference_model_dir")
    return ServeJob(**d | {"model_dir": Path(d["model_dir"]), "devices": tuple(d["devices"]),
                           "reference_model_dir": None if reference is None else Path(reference),
                           "patterns": tuple(Pattern(**p) for p in d["patterns"]),
                           "accuracy": AccuracyRules(**d["accuracy"] | {"prompts": tuple(d["accuracy"]["prompts"])})})


def completion_to_dict(c: Completion) -> dict:
    # the alternatives as pairs: JSON would turn their token-id keys into strings
    return {"token_ids": c.token_ids, "logprobs": c.logprobs, "top": [list(alts.items()) for alts in c.top]}


def completion_from_dict(d: dict) -> Completion:
    return Completion(d["token_ids"], d["logprobs"], [{int(t): lp for t, lp in alts} for alts in d["top"]])


def runs_to_dict(runs: dict[str, aiperf.PatternRun] | None, out: Path) -> dict | None:
    return None if runs is None else {name: {"metrics": r.metrics, "errors": r.errors,
                                             "dir": str(r.out_dir.relative_to(out))} for name, r in runs.items()}


def runs_from_dict(d: dict, out: Path) -> dict[str, aiperf.PatternRun]:
    """The runs with their folders under `out`: where the controller fetched them to."""
    return {name: aiperf.PatternRun(name, r["metrics"], r["errors"], out / r["dir"]) for name, r in d.items()}


# -- the host's readiness -----------------------------------------------------------
def problems(model_dir: Path, baseline: str | None = None) -> list[str]:
    """What this host lacks to serve model_dir, and to run `baseline` when it names an engine
    (vllm, sglang); each a line a person can act on."""
    out = []
    missing = [f for f in ("config.json", "tokenizer.json") if not (model_dir / f).is_file()]
    if not model_dir.is_dir():
        out.append(f"no model directory {model_dir} (it must be there: checkpoints are not shipped)")
    elif missing:
        out.append(f"{model_dir} has no {' and '.join(missing)}: not a model directory")
    try:
        aiperf.aiperf_command()
    except aiperf.AIPerfError:
        out.append(f"no aiperf beside {sys.executable} or on PATH (pip install aiperf into that environment)")
    lacking = [m for m in ("torch", "transformers", "aiohttp") if importlib.util.find_spec(m) is None]
    if lacking:
        out.append(f"{sys.executable} cannot import {', '.join(lacking)}")
    engine = engine_missing(baseline) if baseline in ENGINES else None
    if engine:
        out.append(engine)
    return out


# -- sessions -------------------------------------------------------------------------
def exchange_names(pattern: str | None) -> tuple[str, str]:
    """The files of one accuracy handshake: the completions, the controller's decision. Before load
    (pattern None) or under a pattern's load: pattern names are [a-z0-9-] (targets.TrafficPattern)."""
    if pattern is None:
        return "completions.json", "decision.json"
    return f"under-load-{pattern}.json", f"under-load-{pattern}.decision.json"


class ControllerJudged(Reference):
    """The reference as a candidate's host sees it: prompts, no answers. The completions (every
    replica's before load, the balancer's under each pattern's) go to the controller, which alone
    holds the reference's answers and judges them, and which knows for itself which prompts they
    answer (harness/serve/under_load.sample); its reply says only whether to go on."""

    def __init__(self, prompts: list[list[int] | None], exchange: Path):
        super().__init__(prompts, [])  # None for a fresh prompt the controller has not sent yet
        self.exchange = exchange
        exchange.mkdir(parents=True, exist_ok=True)

    def judge(self, pattern: str | None, numbers: list[int],
              answers: list[list[Completion]]) -> tuple[bool, str, dict]:
        decided = handshake(self.exchange, pattern, [[completion_to_dict(c) for c in got] for got in answers])
        if decided is None:
            return False, NO_DECISION, {}
        for n, ids in decided.get("prompts", {}).items():  # the next pattern's fresh prompt
            self.prompts[int(n)] = ids
        # the gate's detail and metrics are the controller's: it replaces this one with its own
        return bool(decided["load"]), "judged on the controller", {}


NO_DECISION = f"the controller sent no accuracy decision within {DECISION_WAIT_S:g} s"


def handshake(exchange: Path, pattern: str | None, completions) -> dict | None:
    """One accuracy handshake: `completions` (JSON) written for the controller, then its decision
    (`load`: whether to go on; `prompts`: any it now sends), read and removed; None when none came
    within DECISION_WAIT_S."""
    name, decided = exchange_names(pattern)
    write_atomic(exchange / name, completions)
    decision, deadline = exchange / decided, time.monotonic() + DECISION_WAIT_S
    while not decision.is_file():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    body = json.loads(decision.read_text())
    decision.unlink()  # gone within a poll of being written: a fresh prompt in it lies here no longer
    return body


def reference_session(spec: dict, job: ServeJob, run_dir: Path, out: Path) -> dict:
    reference, runs = reference_answers(job, out, random.Random(spec["seed"]))
    write_atomic(run_dir / "answers.json", {"prompts": reference.prompts,
                                            "completions": [completion_to_dict(c) for c in reference.completions]})
    return {"runs": runs_to_dict(runs, out)}


def baseline_session(spec: dict, job: ServeJob, run_dir: Path, out: Path) -> dict:
    return {"runs": runs_to_dict(measure_baseline(job, out), out)}


def candidate_session(spec: dict, job: ServeJob, run_dir: Path, out: Path) -> dict:
    cand = EngineCandidate.from_dict(spec["candidate"])
    kernels = dict(cand.kernels)
    for op, source in spec.get("sources", {}).items():  # free kernels: their files are the controller's
        path = out / "kernels" / f"{op}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        kernels[op] = kernels[op] | {"path": str(path)}
    cand = EngineCandidate.from_dict(cand.to_dict() | {"kernels": kernels})
    reference = ControllerJudged(spec["prompts"], run_dir / "exchange")
    served = serve(job, cand, reference, out, spec.get("command"), judge_with=reference.judge)
    return {"verdict": json.loads(served.verdict.to_json()), "runs": runs_to_dict(served.runs, out),
            "metrics": served.metrics}


SESSIONS = {"reference": reference_session, "baseline": baseline_session, "candidate": candidate_session}


def run(job_path: Path, run_dir: Path) -> int:
    spec = json.loads(job_path.read_text())
    job = job_from_dict(spec["job"])
    out = run_dir / "out"
    out.mkdir(parents=True, exist_ok=True)
    missing = problems(job.model_dir, job.baseline if spec["kind"] == "baseline" else None)
    if missing:
        result = {"setup_error": "; ".join(missing)}
    else:
        try:
            result = SESSIONS[spec["kind"]](spec, job, run_dir, out)
        except (ServerError, aiperf.AIPerfError) as e:  # the run's error, raised again on the controller
            result = {"error": {"type": type(e).__name__, "message": str(e)}}
    write_atomic(run_dir / "result.json", result)
    return 0


def kill(marker: str) -> int:
    """SIGKILL to every process of this user whose environment carries the session's marker: the
    servers and AIPerf run in sessions of their own, so no process group holds them all."""
    needle = f"{MARKER_VAR}={marker}".encode()
    for _ in range(3):  # a process may fork while the first pass reads /proc
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):  # gone meanwhile, or another user's
                continue
        time.sleep(0.1)
    return 0


def write_atomic(path: Path, data) -> None:
    """A reader polling for the file never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
