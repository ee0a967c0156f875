"""Load a server with AIPerf (`aiperf profile`, run as a command) for one traffic pattern, and
read the metrics the gate compares from its JSON export."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from contract.serve import METRICS, AIPerfError, Pattern, PatternRun

EXPORT = "profile_export_aiperf.json"


def aiperf_command() -> str:
    """The `aiperf` beside this interpreter (a virtual environment's), else the one on PATH."""
    here = Path(sys.executable).parent / "aiperf"
    found = str(here) if here.exists() else shutil.which("aiperf")
    if not found:
        raise AIPerfError("aiperf is not installed on this host (pip install aiperf)")
    return found


def structured_dataset(path: Path, pattern: Pattern) -> Path:
    """Repetitive, structured prompts (CSV rows, JSON records): text whose tokens repeat, the
    case where a server's caching or batching of similar prompts shows. Fixed per pattern name."""
    rng = random.Random(pattern.name)
    n = (pattern.request_count or 64) + pattern.warmup_requests
    lines = []
    for _ in range(n):
        rows, chars = [], 0
        while chars < 4 * pattern.input_tokens_mean:  # ~4 characters a token
            i = rng.randrange(10_000)
            row = rng.choice([f"{i},item-{i % 97},{i * 0.37:.2f},ok\n",
                              json.dumps({"id": i, "name": f"item-{i % 97}", "price": round(i * 0.37, 2)}) + "\n"])
            rows.append(row)
            chars += len(row)
        lines.append(json.dumps({"text": "Continue the records:\n" + "".join(rows)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def command(p: Pattern, url: str, model: str, tokenizer_dir: Path, out_dir: Path) -> list[str]:
    cmd = [aiperf_command(), "profile", "--model", model, "--url", url, "--endpoint-type", p.endpoint,
           "--streaming", "--tokenizer", str(tokenizer_dir), "--artifact-dir", str(out_dir),
           # No --use-server-token-count: AIPerf counts what it received with the model's tokenizer,
           # since a candidate server's `usage` is the candidate's own claim
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
           # the same fixed-length greedy work for every server
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--output-tokens-mean", str(p.output_tokens_mean), "--output-tokens-stddev", str(p.output_tokens_stddev),
           "--random-seed", "0"]
    cmd += ["--concurrency", str(p.concurrency)] if p.concurrency else ["--request-rate", str(p.request_rate)]
    cmd += ["--request-count", str(p.request_count)] if p.request_count else ["--benchmark-duration", str(p.duration_s)]
    if p.warmup_requests:
        cmd += ["--warmup-request-count", str(p.warmup_requests)]
    if p.dataset == "synthetic":
        cmd += ["--synthetic-input-tokens-mean", str(p.input_tokens_mean),
                "--synthetic-input-tokens-stddev", str(p.input_tokens_stddev)]
    else:
        data = structured_dataset(out_dir.parent / f"{p.name}.jsonl", p) if p.dataset == "structured" else p.dataset
        cmd += ["--input-file", str(data), "--custom-dataset-type", "single_turn"]
    return cmd


def run(p: Pattern, url: str, model: str, tokenizer_dir: Path, out_dir: Path, timeout_s: float) -> PatternRun:
    """One `aiperf profile`; its artifacts (exports, inputs, its log) stay in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = command(p, url, model, tokenizer_dir, out_dir)
    # No HF_HUB_OFFLINE: AIPerf (0.13) then looks a local tokenizer directory up in the hub's
    # cache and fails; a local path is loaded without any network access anyway.
    env = {"HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}
    with open(out_dir / "aiperf.log", "wb") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env={**os.environ, **env}, cwd=out_dir, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise AIPerfError(f"aiperf ran past {timeout_s:g} s on pattern {p.name}") from None
    export = out_dir / EXPORT
    if proc.returncode != 0 or not export.is_file():
        tail = (out_dir / "aiperf.log").read_text(errors="replace")[-1500:]
        raise AIPerfError(f"aiperf exited with code {proc.returncode} on pattern {p.name}: {tail}")
    return parse(p.name, export)


def parse(pattern: str, export: Path) -> PatternRun:
    data = json.loads(export.read_text())
    metrics = {}
    for name, (key, stat, _) in METRICS.items():
        value = (data.get(key) or {}).get(stat)
        if value is not None:
            metrics[name] = float(value)
    errors = int(sum(e.get("count", 1) for e in data.get("error_summary") or []))
    completed = (data.get("request_count") or {}).get("avg", 0)
    metrics["requests"] = float(completed)
    return PatternRun(pattern, metrics, errors, export.parent)

