"""The image stage's worker side on a pool host (harness/serve/images.py, there): its servers start
and AIPerf loads them on the host itself, as the text stage's do (harness/serve/remote.py, whose
layout, kill and trust rules these sessions share). The controller (gpu_pool/ssh_images.py) ships
a session's job, runs `python -m harness.serve run-images JOB.json RUN_DIR` there, and fetches
`out/` and `result.json` back.

    images-reference  the held-out images drawn from the controller's seed, the reference server's
                      answers on them, then its metrics on every pattern (the baseline); the images
                      and answers go to `answers.json`, which the controller reads into memory and
                      never stores
    images-candidate  the SAM 3 engine with the shipped kernels, asked the held-out images (with the
                      queries whose mask logits are judged, nothing else of the reference's answers);
                      its answers go to the controller (`exchange/completions.json`), which judges
                      them and answers only whether to go on to the load

`out/`: the server's log, AIPerf's exports and inputs, and a candidate's kernels (`kernels.json`
and `kernels/<op>.py`), fetched and logged.
"""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from contract.images import ImageAccuracyRules, ImagePattern, ImageServeJob
from contract.serve import AIPerfError, ServerError
from harness.serve import aiperf
from harness.serve.images import engine_argv, reference_side, serve_images
from harness.serve.remote import NO_DECISION, handshake, runs_to_dict, write_atomic

MODULES = ("torch", "transformers", "aiohttp", "PIL", "numpy")  # the servers' and the stage's


def job_to_dict(job: ImageServeJob) -> dict:
    return asdict(job) | {"model_dir": str(job.model_dir)}


def job_from_dict(d: dict) -> ImageServeJob:
    rules = d["accuracy"]
    return ImageServeJob(**d | {"model_dir": Path(d["model_dir"]), "patterns": tuple(ImagePattern(**p) for p in
                                                                                     d["patterns"]),
                                "accuracy": ImageAccuracyRules(**rules | {"prompts": tuple(rules["prompts"])})})


def problems(model_dir: Path) -> list[str]:
    """What this host lacks to run the image stage on model_dir (a SAM 3 checkpoint there, aiperf,
    the servers' modules); each a line a person can act on."""
    out = []
    if not model_dir.is_dir():
        out.append(f"no model directory {model_dir} (it must be there: checkpoints are not shipped)")
    elif not all((model_dir / f).is_file() for f in ("config.json", "tokenizer.json")):
        out.append(f"{model_dir} has no config.json and tokenizer.json: not a SAM 3 model directory")
    else:
        try:
            arch = json.loads((model_dir / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            arch = f"unreadable ({type(e).__name__})"
        if arch != "sam3":
            out.append(f"{model_dir} holds a {arch} checkpoint, not SAM 3's (model_type sam3)")
    try:
        aiperf.aiperf_command()
    except AIPerfError:
        out.append(f"no aiperf beside {sys.executable} or on PATH (pip install aiperf into that environment)")
    lacking = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if lacking:
        out.append(f"{sys.executable} cannot import {', '.join(lacking)}")
    return out


def reference_session(spec: dict, job: ImageServeJob, run_dir: Path, out: Path) -> dict:
    images, expected, baseline = reference_side(job, out, random.Random(spec["seed"]))
    write_atomic(run_dir / "answers.json", {"images": images, "answers": expected})
    return {"runs": runs_to_dict(baseline, out)}


def shipped_kernels(spec: dict, out: Path) -> Path | None:
    """The candidate's kernels file as the host holds it (out/kernels.json): the controller's text,
    with each free kernel whose source came along written under out/kernels/ and pointed at there."""
    text = spec.get("kernels_text")
    if text is None:
        return None
    sources = spec.get("sources") or {}
    if sources:  # the controller found them in this file: it is a JSON object of choices
        choices = json.loads(text)
        for op, source in sources.items():
            path = out / "kernels" / f"{op}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
            choices[op] = choices[op] | {"path": str(path)}
        text = json.dumps(choices, indent=1)
    path = out / "kernels.json"
    path.write_text(text)
    return path


def controller_judged(exchange: Path) -> Callable[[list[dict]], tuple[bool, str, dict]]:
    """The accuracy gate as a host runs it: the answers to the controller, which alone holds the
    reference's; its reply says only whether to go on."""
    exchange.mkdir(parents=True, exist_ok=True)

    def judge(got: list[dict]) -> tuple[bool, str, dict]:
        decided = handshake(exchange, None, got)
        if decided is None:
            return False, NO_DECISION, {}
        # the gate's detail and metrics are the controller's: it replaces this one with its own
        return bool(decided["load"]), "judged on the controller", {}

    return judge


def candidate_session(spec: dict, job: ImageServeJob, run_dir: Path, out: Path) -> dict:
    kernels = shipped_kernels(spec, out)
    images = [(image, list(prompts)) for image, prompts in spec["images"]]
    served = serve_images(job, spec["candidate_id"], lambda port: engine_argv(job, port, kernels), out, images,
                          spec["queries"], None, judge_with=controller_judged(run_dir / "exchange"))
    return {"verdict": json.loads(served.verdict.to_json()), "runs": runs_to_dict(served.runs, out),
            "metrics": served.metrics}


SESSIONS = {"images-reference": reference_session, "images-candidate": candidate_session}


def run(job_path: Path, run_dir: Path) -> int:
    spec = json.loads(job_path.read_text())
    job = job_from_dict(spec["job"])
    out = run_dir / "out"
    out.mkdir(parents=True, exist_ok=True)
    missing = problems(job.model_dir)
    if missing:
        result = {"setup_error": "; ".join(missing)}
    else:
        try:
            result = SESSIONS[spec["kind"]](spec, job, run_dir, out)
        except (ServerError, AIPerfError) as e:  # the run's error, raised again on the controller
            result = {"error": {"type": type(e).__name__, "message": str(e)}}
    write_atomic(run_dir / "result.json", result)
    return 0
