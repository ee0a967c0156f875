"""The end-to-end stage for images (SAM 3): the full-precision reference server's answers on
held-out images first, then the candidate server — its masks, boxes and scores judged against
them before any load — then AIPerf on every pattern, against the candidate and against the
reference as the baseline, and the all-metrics gate (contract.serve.compare) between them.

AIPerf sends the requests as raw payload replay (`--endpoint-type raw`, an inputs-JSON file of
complete /v1/segment bodies): its template and chat endpoints build OpenAI-shaped bodies, and
SAM 3's request is an image with a list of prompts, sent verbatim."""
from __future__ import annotations

import base64
import io
import json
import os
import random
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from contract.images import IMAGE_METRICS, ImageAccuracyRules, ImagePattern, ImageServeJob, serving_file
from contract.serve import AIPerfError, PatternRun, Served, ServerError, compare
from contract.verdict import PASS, Verdict
from harness.serve.aiperf import EXPORT, aiperf_command
from harness.serve.server import ServerProcess, free_ports

SERVED_NAME = "infersmith-e2e"


# --- images and requests ------------------------------------------------------------------------

def draw_image(rng: random.Random, size: int) -> str:
    """A base64 PNG: a noisy background with a few filled rectangles and ellipses (things to segment)."""
    from PIL import Image, ImageDraw

    noise = np.random.default_rng(rng.randrange(2**32)).integers(0, 60, (size, size, 3), dtype=np.uint8)
    image = Image.fromarray(noise + np.uint8(rng.randrange(120)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(2, 5)):
        x0, y0 = rng.randrange(size - 8), rng.randrange(size - 8)
        box = (x0, y0, rng.randint(x0 + 4, size), rng.randint(y0 + 4, size))
        fill = tuple(rng.randrange(256) for _ in range(3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=fill)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def image_set(rules: ImageAccuracyRules, rng: random.Random) -> list[tuple[str, list[str]]]:
    """The held-out images, drawn afresh from `rng`, each with prompts_per_image of the prompts."""
    out = []
    for i in range(rules.held_out):
        prompts = [rules.prompts[(i + j) % len(rules.prompts)] for j in range(rules.prompts_per_image)]
        out.append((draw_image(rng, rules.image_size), prompts))
    return out


def segment(url: str, image: str, prompts: list[str], raw: bool = False, raw_queries=None,
            timeout_s: float = 300) -> dict:
    body = {"model": SERVED_NAME, "image": image, "prompts": prompts, "raw": raw}
    if raw_queries is not None:
        body["raw_queries"] = raw_queries
    req = urllib.request.Request(url + "/v1/segment", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def answers(url: str, images: list[tuple[str, list[str]]], reference: list[dict] | None = None) -> list[dict]:
    """Every image's answer with raw outputs, all sent at once (a batching server batches them);
    with `reference`, the mask logits of the queries the reference's answer judged."""
    def one(k: int) -> dict:
        image, prompts = images[k]
        queries = None if reference is None else [r["raw"]["queries"] for r in reference[k]["results"]]
        if queries is None:
            return segment(url, image, prompts, raw=True)
        # one request per prompt only where the prompts' judged queries differ
        return segment(url, image, prompts, raw=True, raw_queries=sorted({q for qs in queries for q in qs}))

    with ThreadPoolExecutor(max(1, len(images))) as pool:
        return list(pool.map(one, range(len(images))))


# --- the accuracy gate --------------------------------------------------------------------------

def _raw(answer: dict) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    raw = answer["raw"]
    logits = np.frombuffer(base64.b64decode(raw["mask_logits"]), dtype="<f4").reshape(raw["mask_shape"])
    return (np.asarray(raw["scores"], dtype=np.float64), np.asarray(raw["boxes"], dtype=np.float64),
            dict(zip(raw["queries"], logits)))


def mask_agreement(candidate: np.ndarray, reference: np.ndarray, margin: float) -> tuple[float, float]:
    """(IoU of the masks logit > 0 over the pixels where |reference| > margin — 1 where neither
    has any there —, the largest |candidate - reference| over the others — 0 where none)."""
    confident = np.abs(reference) > margin
    c, r = candidate[confident] > 0, reference[confident] > 0
    union = np.logical_or(c, r).sum()
    iou = float(np.logical_and(c, r).sum() / union) if union else 1.0
    rest = ~confident
    diff = float(np.abs(candidate[rest] - reference[rest]).max()) if rest.any() else 0.0
    return iou, diff


def judge(candidate: list[dict], reference: list[dict], rules: ImageAccuracyRules) -> tuple[bool, str, dict]:
    """Every held-out image's every prompt: each query's score and box, and the reference's
    judged queries' masks (mask_agreement). The first disagreement fails, named."""
    worst = {"iou": 1.0, "logit": 0.0, "box": 0.0, "score": 0.0}
    judged = 0
    if len(candidate) != len(reference):
        return False, f"{len(candidate)} answers to {len(reference)} images", {}
    for k, (c_answer, r_answer) in enumerate(zip(candidate, reference)):
        if len(c_answer.get("results", [])) != len(r_answer["results"]):
            return False, (f"image {k}: {len(c_answer.get('results', []))} results for "
                           f"{len(r_answer['results'])} prompts"), {}
        for c, r in zip(c_answer["results"], r_answer["results"]):
            where = f"image {k}, prompt {r['prompt']!r}"
            if c.get("prompt") != r["prompt"]:
                return False, f"{where}: answered as prompt {c.get('prompt')!r}", {}
            c_scores, c_boxes, c_masks = _raw(c)
            r_scores, r_boxes, r_masks = _raw(r)
            if c_scores.shape != r_scores.shape or c_boxes.shape != r_boxes.shape:
                return False, f"{where}: {c_scores.shape[0]} queries, the reference has {r_scores.shape[0]}", {}
            # a NaN compares false with every tolerance: not finite is wrong, said so
            if not all(np.isfinite(a).all() for a in (c_scores, c_boxes, *c_masks.values())):
                return False, f"{where}: scores, boxes or mask logits not finite (NaN or infinite)", {}
            score = float(np.abs(c_scores - r_scores).max())
            box = float(np.abs(c_boxes - r_boxes).max())
            worst["score"], worst["box"] = max(worst["score"], score), max(worst["box"], box)
            if score > rules.score_atol:
                q = int(np.abs(c_scores - r_scores).argmax())
                return False, (f"{where}, query {q}: score {c_scores[q]:.4g} vs the reference's {r_scores[q]:.4g} "
                               f"(|Δ| {score:.3g} > {rules.score_atol:g})"), {}
            if box > rules.box_atol:
                q = int(np.abs(c_boxes - r_boxes).max(axis=1).argmax())
                return False, (f"{where}, query {q}: box {np.round(c_boxes[q], 4).tolist()} vs the reference's "
                               f"{np.round(r_boxes[q], 4).tolist()} (|Δ| {box:.3g} > {rules.box_atol:g} of the "
                               "image's side)"), {}
            for q, r_logits in r_masks.items():
                if q not in c_masks:
                    return False, f"{where}: no mask logits for query {q}", {}
                if c_masks[q].shape != r_logits.shape:
                    return False, f"{where}, query {q}: mask {c_masks[q].shape}, the reference's {r_logits.shape}", {}
                iou, diff = mask_agreement(c_masks[q], r_logits, rules.mask_margin)
                worst["iou"], worst["logit"] = min(worst["iou"], iou), max(worst["logit"], diff)
                judged += 1
                if iou < rules.mask_iou:
                    return False, (f"{where}, query {q}: mask IoU {iou:.4f} where the reference is confident "
                                   f"(|logit| > {rules.mask_margin:g}) < {rules.mask_iou:g}"), {}
                allowed = rules.logit_rtol * float(np.abs(r_logits).max())
                if diff > allowed:
                    return False, (f"{where}, query {q}: mask logit off by {diff:.3g} where the reference is "
                                   f"not confident (> {rules.logit_rtol:g} of its largest |logit|, {allowed:.3g})"), {}
    detail = (f"{len(reference)} held-out images, {judged} masks: IoU ≥ {worst['iou']:.4f} where confident, "
              f"|Δlogit| ≤ {worst['logit']:.3g} elsewhere; |Δbox| ≤ {worst['box']:.3g}, |Δscore| ≤ {worst['score']:.3g}")
    return True, detail, {"accuracy/min_mask_iou": worst["iou"], "accuracy/max_mask_logit_diff": worst["logit"],
                          "accuracy/max_box_diff": worst["box"], "accuracy/max_score_diff": worst["score"],
                          "accuracy/masks_compared": judged}


# --- AIPerf -------------------------------------------------------------------------------------

def dataset(path: Path, p: ImagePattern) -> Path:
    """AIPerf's inputs-JSON file: one complete /v1/segment body per session, images drawn per
    pattern name (the same load for every server)."""
    rng = random.Random(p.name)
    prompts = ImageAccuracyRules().prompts
    bodies = [{"model": SERVED_NAME, "image": draw_image(rng, p.image_size),
               "prompts": [prompts[(i + j) % len(prompts)] for j in range(p.prompts_per_image)]}
              for i in range(min(16, p.request_count + p.warmup_requests))]
    path.write_text(json.dumps({"data": [{"session_id": f"{p.name}-{i}", "payloads": [b]}
                                         for i, b in enumerate(bodies)]}))
    return path


def command(p: ImagePattern, url: str, tokenizer_dir: Path, out_dir: Path) -> list[str]:
    cmd = [aiperf_command(), "profile", "--model", SERVED_NAME, "--url", url, "--endpoint-type", "raw",
           "--custom-endpoint", "/v1/segment", "--input-file", str(dataset(out_dir.parent / f"{p.name}.json", p)),
           "--custom-dataset-type", "inputs_json", "--tokenizer", str(tokenizer_dir), "--artifact-dir", str(out_dir),
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--random-seed", "0",
           "--concurrency", str(p.concurrency), "--request-count", str(p.request_count)]
    return cmd + (["--warmup-request-count", str(p.warmup_requests)] if p.warmup_requests else [])


def run(p: ImagePattern, url: str, tokenizer_dir: Path, out_dir: Path, timeout_s: float) -> PatternRun:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}
    with open(out_dir / "aiperf.log", "wb") as log:
        try:
            proc = subprocess.run(command(p, url, tokenizer_dir, out_dir), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, env=env, cwd=out_dir, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise AIPerfError(f"aiperf ran past {timeout_s:g} s on pattern {p.name}") from None
    export = out_dir / EXPORT
    if proc.returncode != 0 or not export.is_file():
        tail = (out_dir / "aiperf.log").read_text(errors="replace")[-1500:]
        raise AIPerfError(f"aiperf exited with code {proc.returncode} on pattern {p.name}: {tail}")
    return parse(p.name, export)


def parse(pattern: str, export: Path) -> PatternRun:
    """IMAGE_METRICS from AIPerf's export; a request's own images/s from its latency (1000 / ms)."""
    data = json.loads(export.read_text())
    metrics = {}
    for name, (key, stat, _) in IMAGE_METRICS.items():
        value = (data.get(key) or {}).get(stat)
        if value is None:
            continue
        metrics[name] = 1000.0 / value if name.startswith("images_per_s_per_request") and value > 0 else float(value)
    errors = int(sum(e.get("count", 1) for e in data.get("error_summary") or []))
    metrics["requests"] = float((data.get("request_count") or {}).get("avg", 0))
    return PatternRun(pattern, metrics, errors, export.parent)


# --- the stage ----------------------------------------------------------------------------------

def reference_argv(job: ImageServeJob, port: int) -> list[str]:
    return [job.python, "-m", "engine_templates.sam3_engine", "serve-reference", "--model-dir", str(job.model_dir),
            "--dtype", job.reference_dtype, "--device", job.device, "--port", str(port),
            "--served-model-name", SERVED_NAME]


def engine_argv(job: ImageServeJob, port: int, kernels: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    return [job.python, "-m", "engine_templates.sam3_engine", "serve", "--model-dir", str(job.model_dir),
            "--dtype", job.dtype, "--device", job.device, "--port", str(port), "--served-model-name", SERVED_NAME,
            *(["--kernels", str(kernels)] if kernels else []), *extra]


def _load(job: ImageServeJob, server: ServerProcess, out: Path) -> dict[str, PatternRun]:
    return {p.name: run(p, server.url, job.model_dir, out / "aiperf" / p.name, job.pattern_timeout_s)
            for p in job.patterns}


def reference_side(job: ImageServeJob, out: Path, rng: random.Random) -> tuple[list[tuple[str, list[str]]],
                                                                                   list[dict], dict[str, PatternRun]]:
    """The held-out images, the reference's answers on them, and its metrics under every pattern
    (the baseline); its log and AIPerf's exports under `out`. A reference that fails under load is
    an error of the run."""
    images = image_set(job.accuracy, rng)
    port = free_ports(1)[0]
    with ServerProcess("reference server", reference_argv(job, port), out / "server.log", job.env, port) as ref:
        ref.start(job.start_timeout_s)
        expected = answers(ref.url, images)
        baseline = _load(job, ref, out)
    for name, r in baseline.items():
        if r.errors:
            raise ServerError(f"the reference failed on pattern {name} ({r.errors} failed requests)")
    return images, expected, baseline


def only_queries(expected: list[dict]) -> list[dict]:
    """The reference's answers stripped to what the candidate is asked for: per image and prompt,
    the queries whose mask logits are judged (no score, box or mask of the reference's)."""
    return [{"results": [{"raw": {"queries": r["raw"]["queries"]}} for r in a["results"]]} for a in expected]


def serve_images(job: ImageServeJob, candidate_id: str, argv_for: Callable[[int], list[str]], out: Path,
                 images: list[tuple[str, list[str]]], expected: list[dict], baseline: dict[str, PatternRun] | None,
                 judge_with: Callable[[list[dict]], tuple[bool, str, dict]] | None = None) -> Served:
    """The candidate server (argv_for(port)): accuracy on the held-out images, then every pattern;
    with `baseline`, the all-metrics gate. Its log and AIPerf's exports under `out`. The answers
    are judged against `expected` (the reference's), or by `judge_with` (a pool host hands them to
    the controller, and `expected` is only_queries' of them)."""
    judge_with = judge_with or (lambda got: judge(got, expected, job.accuracy))
    verdict = Verdict(op="engine", candidate_id=candidate_id, stages=["serve"], device={"kind": job.device})
    result = Served(verdict)
    t0 = time.monotonic()
    port = free_ports(1)[0]
    with ServerProcess("candidate server", argv_for(port), out / "server.log", job.env, port) as server:
        try:
            server.start(job.start_timeout_s)
        except ServerError as e:
            verdict.crash("server_start", str(e))
        if verdict.status == PASS:
            try:
                got = answers(server.url, images, expected)
            except (OSError, ValueError, KeyError) as e:
                verdict.gate("accuracy", False, f"no usable answer with raw outputs: {type(e).__name__}: {e}")
            else:
                passed, detail, metrics = judge_with(got)
                result.metrics |= metrics
                verdict.gate("accuracy", passed, detail)
        for p in job.patterns if verdict.status == PASS else ():
            try:
                result.runs[p.name] = r = run(p, server.url, job.model_dir, out / "aiperf" / p.name,
                                              job.pattern_timeout_s)
            except AIPerfError as e:
                verdict.crash("load", str(e))
                break
            if not server.alive:
                verdict.crash("server_died", f"the candidate server exited with code {server.proc.returncode} "
                                             f"during pattern {p.name}")
                break
            if r.errors:
                verdict.gate("load", False, f"{r.errors} of {r.metrics['requests']:.0f} requests failed on {p.name}")
                break
        verdict.log_tail = server.log_tail()
    if verdict.status == PASS and baseline is not None:
        compare(result, baseline, job.margin, IMAGE_METRICS)
    verdict.wall_s = time.monotonic() - t0
    return result


def stage(job: ImageServeJob, candidate_id: str, argv_for: Callable[[int], list[str]], out: Path,
          seed: int | None = None) -> Served:
    """The whole image stage on this host: the reference's answers and baseline (under
    out/reference), then the candidate (under out/candidate)."""
    rng = random.Random(seed if seed is not None else random.SystemRandom().randrange(2**63))
    images, expected, baseline = reference_side(job, out / "reference", rng)
    return serve_images(job, candidate_id, argv_for, out / "candidate", images, expected, baseline)


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.serve.images --model-dir DIR [...]`: the image stage on this host, the
    engine against the reference, on every pattern (contract.images.PATTERNS, or a serving
    file's); the verdict and metrics as JSON on stdout, the servers' logs and AIPerf's exports
    under --out."""
    import argparse
    import sys
    from dataclasses import asdict

    parser = argparse.ArgumentParser(prog="python -m harness.serve.images", description=main.__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--serving", type=Path, help="a JSON serving file: traffic, accuracy, margin")
    parser.add_argument("--margin", type=float, default=None, help="default: the serving file's, else 0")
    parser.add_argument("--kernels", type=Path, help="the engine's kernels file (sam3_engine/ops.py)")
    parser.add_argument("--patterns", default="", help="only these patterns (comma-separated)")
    args = parser.parse_args(argv)
    try:
        patterns, rules, margin = serving_file(args.serving) if args.serving else (None, ImageAccuracyRules(), None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from contract.images import PATTERNS

    known = {p.name: p for p in patterns or PATTERNS}
    wanted = [n for n in args.patterns.split(",") if n] or list(known)
    if not (args.model_dir / "config.json").is_file() or any(n not in known for n in wanted):
        print(f"error: --model-dir needs a config.json; --patterns from {', '.join(known)}", file=sys.stderr)
        return 2
    margin = args.margin if args.margin is not None else margin if margin is not None else 0.0
    job = ImageServeJob(args.model_dir, args.dtype, args.device, {}, tuple(known[n] for n in wanted),
                        rules, margin, 900, 600, sys.executable)
    result = stage(job, "sam3-engine", lambda port: engine_argv(job, port, args.kernels), args.out)
    print(json.dumps({"verdict": asdict(result.verdict), "metrics": result.metrics}, indent=1, default=str))
    return 0 if result.verdict.status == PASS else 1


if __name__ == "__main__":
    raise SystemExit(main())
