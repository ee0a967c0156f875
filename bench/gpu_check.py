"""The GPU acceptance suite (`make gpu-check`): every path that only a GPU exercises, in one device
call of at most 9 minutes, and one report of it.

    bash bench/gpu_check.sh              # on a GPU host: installs the carried wheels, then this
    python3 bench/gpu_check.py --plan    # anywhere: what it would run, each part's time limit

Its parts run one after another, each in a process group of its own under its own time limit (a
part that runs over is stopped and reported, and the next part starts):

- `fp8-engine`: tests/test_gpu_engine.py — the FP8 engine on each scaled path under CUDA graphs,
  speculative decoding under CUDA graphs;
- `gauntlet`: `infersmith gauntlet --gpu`, the cases the manifest marks `gpu_only` or `gpu`;
- `serve`: the end-to-end stage on the tiny preset's random checkpoint, one AIPerf pattern
  (bench/gpu-check-serving.json): passed when it judged — servers up, accuracy before and under
  load, TTFT and throughput measured on both sides (on a model this small the engine need not be
  faster);
- `gpu-tests`: every other test module with a test marked `gpu`, `pytest -m gpu`, with the time
  the parts before it left.

The modules and the cases are read from the tests and the manifest when the suite runs, never
listed here; tests/test_gpu_check.py checks that the plan misses none. The report, per part and
per test or case (pass, fail, skipped with its reason, or not run and why), with the GPU, the
versions and the times, goes to $OUT/gpu-check.md and $OUT/gpu-check.json (OUT: default
./gpu-check), written again after every part so that a call cut short still leaves one.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 510  # the parts' time together: 9 minutes less what installing the wheels and the report take
OWN_MODULE = "tests/test_gpu_engine.py"  # the fp8-engine part's; every other gpu module is gpu-tests'
PYTEST_LINE = re.compile(r"^(tests/\S+::\S+(?:\[[^\]]*\])?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*)\))?")
SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] (tests/[^:]+):\d+: (.*)")  # pytest -rs: where and why, not which
GAUNTLET_LINE = re.compile(r"^\s+(ok |BAD) (\S+): (expected .*?)(?: \[\d+/\d+\])?$")


@dataclass
class Part:
    name: str
    what: str
    commands: list[list[str]]
    limit_s: float  # the most it may take (and never more than the budget the parts before it left)
    covers: list[str] = field(default_factory=list)  # test modules or gauntlet cases


@dataclass
class Outcome:
    part: str
    status: str  # pass, fail, timeout, not run
    seconds: float
    detail: str
    items: list[dict] = field(default_factory=list)  # {name, status, detail}


def gpu_modules(tests: Path) -> list[str]:
    """Every test module with a test marked `gpu` (`pytest.mark.gpu` on a test, a class or the module)."""
    def marked(source: str) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "gpu" and isinstance(n.value, ast.Attribute)
                   and n.value.attr == "mark" for n in ast.walk(ast.parse(source)))

    return sorted(f"tests/{p.name}" for p in tests.glob("test_*.py") if marked(p.read_text()))


def gauntlet_cases() -> list[str]:
    from gauntlet import load_cases

    return [c.name for c in load_cases() if c.on_gpu_check]


def plan(tests: Path = ROOT / "tests") -> list[Part]:
    py = sys.executable
    modules = gpu_modules(tests)
    others = [m for m in modules if m != OWN_MODULE]
    pytest = [py, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-m", "gpu"]
    tiny = str(Path(tempfile.gettempdir()) / "infersmith-gpu-check-tiny")
    return [
        Part("fp8-engine", "the FP8 engine on each scaled path and speculative decoding, under CUDA graphs",
             [pytest + [OWN_MODULE]], 140, [OWN_MODULE] if OWN_MODULE in modules else []),
        Part("gauntlet", "the gauntlet cases a GPU checks more of than a CPU",
             [[py, "-m", "cli", "gauntlet", "--gpu", "--jobs", "4", "--stage-timeout", "60"]], 90, gauntlet_cases()),
        Part("serve", "the end-to-end stage on the tiny preset, one AIPerf pattern",
             [[py, "-m", "engine_templates.engine", "random-checkpoint", "--preset", "tiny", "--out", tiny,
               "--device", "cuda", "--force"],
              [py, "-m", "cli", "serve-bench", "--model-dir", tiny, "--model", "tiny", "--dtype", "bf16",
               "--serving", "bench/gpu-check-serving.json", "--stage-timeout", "60", "--json"]], 120,
             ["serve-bench tiny, pattern chat-short"]),
        Part("gpu-tests", "every other test marked gpu", [pytest + others], BUDGET_S, others),
    ]


def run_part(part: Part, limit_s: float, log: Path) -> Outcome:
    start, out, stdout = time.monotonic(), "", ""
    for argv in part.commands:
        left = limit_s - (time.monotonic() - start)
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        stopped = ""
        try:
            stdout, stderr = proc.communicate(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            stopped = f"stopped at its limit of {limit_s:.0f} s"
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
        out += f"$ {' '.join(argv)}\n{stdout}{stderr}"
        log.write_text(out)
        if stopped or (proc.returncode and argv is not part.commands[-1]):
            break  # (the serve stage without its checkpoint)
    return judge(part, out, stdout, None if stopped else proc.returncode, time.monotonic() - start, stopped)


def judge(part: Part, out: str, stdout: str, code: int | None, seconds: float, stopped: str) -> Outcome:
    """The part's verdict and its items, from what its commands printed (`stdout`: the last one's)."""
    items = []
    if part.name == "serve":
        try:
            result = json.JSONDecoder().raw_decode(stdout[stdout.index("{"):])[0]
        except ValueError:
            return Outcome(part.name, "timeout" if stopped else "fail", seconds, stopped or tail(out))
        gates = [g for g in result["gates"] if g["name"] != "all_metrics"]
        # TTFT and throughput on both sides (a tiny model's tokens can come in one read: an
        # inter-token latency of 0, rightly, and no per-user throughput)
        measured = sum((r["candidate"] or 0) > 0 and (r["baseline"] or 0) > 0 for r in result["table"]
                       if r["metric"] in ("ttft_p50_ms", "output_tps")) == 2
        items = [{"name": g["name"], "status": "pass" if g["passed"] else
                  "fail (not required here)" if g["name"] == "all_metrics" else "fail", "detail": g["detail"]}
                 for g in result["gates"]]
        ok = all(g["passed"] for g in gates) and measured and result["table"]
        return Outcome(part.name, "pass" if ok else "fail", seconds,
                       f"judged: verdict {result['verdict']} (speed not required here)" if ok
                       else "not judged: a gate other than the metrics failed, or TTFT or throughput is missing",
                       items)
    for line in out.splitlines():
        if m := PYTEST_LINE.match(line):
            status = {"PASSED": "pass", "XFAIL": "pass", "SKIPPED": "skipped"}.get(m[2], "fail")
            items.append({"name": m[1], "status": status, "detail": m[3] or ""})
        elif m := GAUNTLET_LINE.match(line):
            items.append({"name": m[2], "status": "pass" if m[1] == "ok " else "fail", "detail": m[3]})
    reasons: dict[str, list[str]] = {}
    for m in filter(None, map(SKIP_REASON.match, out.splitlines())):
        reasons.setdefault(m[1], []).append(m[2])
    for i in items:
        if i["status"] == "skipped" and not i["detail"]:
            i["detail"] = "; ".join(dict.fromkeys(reasons.get(i["name"].split("::")[0], ["no reason printed"])))
    if part.name == "gauntlet":
        done = {i["name"] for i in items}
        items += [{"name": c, "status": "not run", "detail": stopped or "not in the command's output"}
                  for c in part.covers if c not in done]
    if stopped:
        return Outcome(part.name, "timeout", seconds, stopped, items)
    if "no tests ran" in out or (part.name != "gauntlet" and not items):
        return Outcome(part.name, "fail", seconds, "no test ran: " + tail(out), items)
    ok = code == 0 and not any(i["status"] in ("fail", "not run") for i in items)
    skipped = [i["name"] for i in items if i["status"] == "skipped"]
    detail = tail(out) if not ok else f"{len(skipped)} skipped: {', '.join(skipped)}" if skipped else ""
    return Outcome(part.name, "pass" if ok else "fail", seconds, detail, items)


def tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "prefect", "mlflow-skinny", "aiperf", "transformers"):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = "absent"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["gpu"] = smi.stdout.strip() or f"none (nvidia-smi: {smi.stderr.strip() or smi.returncode})"
    except FileNotFoundError:
        env["gpu"] = "none (no nvidia-smi)"
    import torch

    env["cuda"] = torch.version.cuda or "none"
    env["cuda_available"] = torch.cuda.is_available()
    return env


def write_report(out: Path, env: dict, outcomes: list[Outcome], started: float, parts: list[Part]) -> None:
    done = {o.part for o in outcomes}
    rows = outcomes + [Outcome(p.name, "not run", 0, "the call ended before it") for p in parts if p.name not in done]
    total = time.monotonic() - started
    verdict = "pass" if rows and all(o.status == "pass" for o in rows) else "fail"
    (out / "gpu-check.json").write_text(json.dumps({"verdict": verdict, "seconds": round(total, 1), "environment": env,
                                                    "parts": [asdict(o) for o in rows]}, indent=2) + "\n")
    md = [f"# GPU acceptance: {verdict}, {total:.0f} s", "",
          " · ".join(f"{k} {v}" for k, v in env.items()), "",
          "| part | result | seconds | detail |", "| --- | --- | --- | --- |"]
    md += [f"| {o.part} | {o.status} | {o.seconds:.0f} | {o.detail[:300]} |" for o in rows]
    for o in rows:
        if o.items:
            md += ["", f"## {o.part}", ""] + [f"- {i['status']}: `{i['name']}` {i['detail'][:200]}".rstrip()
                                               for i in o.items]
    (out / "gpu-check.md").write_text("\n".join(md) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true", help="print the plan and run nothing")
    ap.add_argument("--json", action="store_true", help="with --plan: as JSON")
    ap.add_argument("--tests", type=Path, default=ROOT / "tests", help="where the test modules are (default tests/)")
    args = ap.parse_args()
    parts = plan(args.tests)
    if args.plan:
        if args.json:
            print(json.dumps({"budget_s": BUDGET_S, "parts": [asdict(p) for p in parts]}, indent=2))
        else:
            for p in parts:
                limit = f"what the others leave of {BUDGET_S} s" if p.limit_s >= BUDGET_S else f"{p.limit_s:.0f} s"
                print(f"{p.name} (at most {limit}): {p.what}")
                print("".join(f"  - {c}\n" for c in p.covers), end="")
        return 0
    out = Path(os.environ.get("OUT") or ROOT / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    started, outcomes = time.monotonic(), []
    env = environment()
    for part in parts:
        left = BUDGET_S - (time.monotonic() - started)
        if not env["cuda_available"]:
            outcomes.append(Outcome(part.name, "not run", 0, "CUDA is not available here"))
        elif left < 20:
            outcomes.append(Outcome(part.name, "not run", 0, f"only {left:.0f} s of the {BUDGET_S} s budget left"))
        else:
            print(f"gpu-check: {part.name} (at most {min(part.limit_s, left):.0f} s)", file=sys.stderr, flush=True)
            outcomes.append(run_part(part, min(part.limit_s, left), out / f"gpu-check-{part.name}.log"))
            print(f"gpu-check: {part.name}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s "
                  f"{outcomes[-1].detail[:200]}", file=sys.stderr, flush=True)
        write_report(out, env, outcomes, started, parts)
    print((out / "gpu-check.md").read_text())
    return 0 if all(o.status == "pass" for o in outcomes) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
