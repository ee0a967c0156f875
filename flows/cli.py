"""The `infersmith` command. Exit codes: 0 success (a candidate passed), 1 a candidate
failed or crashed or a run failed, 2 a usage error (bad option, unknown op or preset,
unreadable or malformed candidate file)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from tracking.errors import TrackingStoreError

USAGE_ERROR = 2


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _prefect_unreachable(e: BaseException) -> str | None:
    """The URL of the Prefect server that PREFECT_API_URL names, where `e` (or what it arose
    from) is a request to it that could not connect; else None."""
    import httpx
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    while url and e is not None:
        if isinstance(e, httpx.TransportError):
            try:
                if str(e.request.url).startswith(url.rstrip("/")):
                    return url
            except RuntimeError:  # raised without its request
                pass
        e = e.__cause__ or e.__context__
    return None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _gpu_classes() -> str:
    from typing import get_args

    from gpu_pool.pool import GPUClassName

    return ", ".join(("any",) + get_args(GPUClassName))


def _add_target_options(p: argparse.ArgumentParser, kernel: bool = True) -> None:
    """The target's options; `kernel`: also those only the kernel stages read (shapes, tolerance,
    input sets), which the end-to-end commands do not take."""
    g = p.add_argument_group("target")
    g.add_argument("--model", default="qwen3-8b", help="model preset (see `infersmith ops`); default qwen3-8b")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    g.add_argument("--gpu-class", default="any", help=f"run only on this GPU class ({_gpu_classes()})")
    if kernel:
        g.add_argument("--decode-batches", type=_ints, help="e.g. 1,8,32,128 (default from the preset)")
        g.add_argument("--prefill-tokens", type=_ints, help="e.g. 2048,16384")
        g.add_argument("--contexts", type=_ints, help="attention context lengths, e.g. 4096,32768")
        g.add_argument("--rtol", type=float, help="relative-error tolerance (default per dtype)")
        g.add_argument("--seeds", type=int, default=3, help="random input sets per shape when checking")
    g.add_argument("--stage-timeout", type=float, default=600.0, help="seconds one stage may run")


def _validated(model, data: dict, what: str):
    """A pydantic model from options, its first error as a usage error."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise UsageError(f"bad {what}: {where}: {err['msg'].removeprefix('Value error, ')}") from None


def _target(args, candidates: int = 1, wall_clock: float = 3600.0, plateau: int = 24):
    from targets import TINY_WORKLOAD, Target, Workload, is_tiny

    data = {"model": args.model, "dtype": args.dtype, "gpu_class": args.gpu_class,
            "budget": {"candidates": candidates, "wall_clock_s": wall_clock, "plateau": plateau,
                       "stage_timeout_s": args.stage_timeout}}
    if hasattr(args, "rtol"):  # the kernel options (_add_target_options)
        data |= {"rtol": args.rtol, "seeds": args.seeds}
        workload = {k: getattr(args, k) for k in ("decode_batches", "prefill_tokens", "contexts")
                    if getattr(args, k) is not None}
        if workload:
            base = TINY_WORKLOAD if is_tiny(args.model) else Workload()
            data["workload"] = base.model_dump() | workload
    return _validated(Target, data, "target")


def _pool(path: str | None):
    from gpu_pool.pool_file import PoolFileError, load_pool

    try:
        return load_pool(path)
    except PoolFileError as e:
        raise UsageError(f"bad pool file: {e}") from None


def _pool_with(path: str | None, gpu_class: str):
    """The pool and its slots of the class, refused before anything starts when it has none."""
    pool = _pool(path)
    slots = pool.slots(gpu_class)
    if not slots:
        has = ", ".join(sorted({h.gpu_class for h in pool.hosts}))
        raise UsageError(f"the pool has no host of GPU class {gpu_class} (its hosts' classes: {has})")
    return pool, slots


def _op(name: str):
    from engine_templates.ops import OPS

    if name not in OPS:
        raise UsageError(f"unknown op {name!r}; known: {', '.join(sorted(OPS))}")
    return OPS[name]


def cmd_ops(args) -> int:
    from engine_templates.models import PRESETS
    from engine_templates.ops import OPS

    for op in OPS.values():
        print(f"{op.signature}\n    {op.summary}")
        for t in op.templates.values():
            print(f"    template {t.name}: {t.size()} points over {', '.join(t.space)}")
    print("model presets: " + ", ".join(PRESETS))
    return 0


def _shapes_fit(op, target) -> None:
    """An op that cannot take this model (fused_moe on a dense preset, say) is a usage error."""
    w = target.workload
    try:
        op.shapes(target.dims, w.decode_batches, w.prefill_tokens, w.contexts)
    except ValueError as e:
        raise UsageError(f"{op.name} on {target.model}: {e}") from None


def _open_store() -> None:
    """Open the tracking store before a flow starts: a store this MLflow cannot open is then one
    line (TrackingStoreError, in main) rather than a traceback that Prefect logs from the flow."""
    from tracking.store import TrackingConfig, client

    client(TrackingConfig.from_env())


def cmd_evaluate(args) -> int:
    from contract.job import screen_signature

    op = _op(args.op)
    target = _target(args)
    _shapes_fit(op, target)
    path = Path(args.candidate)
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read candidate {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    problem = screen_signature(source, op.name, op.arg_names)
    if problem:
        raise UsageError(f"{path}: {problem}")
    pool, _ = _pool_with(args.pool, target.gpu_class)
    from flows.evaluate_op import evaluate_candidate

    _open_store()
    result = evaluate_candidate(op=op.name, source=source, target=target, name=path.name, pool=pool)
    verdict = result["verdict"]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(_verdict_text(verdict, result))
    return 0 if verdict["status"] == "pass" else 1


def _verdict_text(v: dict, result: dict) -> str:
    lines = [f"status: {v['status']}"]
    lines += [f"  {'ok  ' if g['passed'] else 'FAIL'} {g['name']}: {g['detail']}" for g in v["gates"]]
    for t in v["timings"]:
        us = (t["candidate_us"] + t["candidate_us_repeat"]) / 2  # ShapeTiming.measured_us
        comp = f"  compile {t['compile_us']:.1f} us" if t["compile_us"] else ""
        lines.append(f"  {t['label']}: {us:.1f} us  eager {t['eager_us']:.1f} us{comp}"
                     f"  roofline {100 * t['roofline_us'] / us:.1f}%")
    if v["timings"] and not v["device"].get("gpu_timing"):
        lines.append("  (no GPU: timings are the Triton interpreter's and say nothing about a GPU)")
    stages = ", ".join(f"{k.split('/')[1]} {v:.1f} s" for k, v in result.items() if k.startswith("stage_seconds/"))
    lines.append(f"mlflow run: {result['run_id']}  gpu_seconds: {result['gpu_seconds']:.1f} ({stages})")
    return "\n".join(lines)


def cmd_optimize(args) -> int:
    op = _op(args.op)
    target = _target(args, candidates=args.budget, wall_clock=args.wall_clock, plateau=args.plateau)
    _shapes_fit(op, target)
    if args.template and args.template not in op.templates:
        raise UsageError(f"{op.name} has no template {args.template!r}; known: {', '.join(op.templates)}")
    pool, _ = _pool_with(args.pool, target.gpu_class)
    from flows.optimize_op import optimize_op

    _open_store()
    optimize_op(op=op.name, target=target, proposer=args.proposer, template=args.template, seed=args.seed,
                pool=pool)
    return 0


def cmd_leaderboard(args) -> int:
    from tracking.history import board
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    op = _op(args.op)
    from engine_templates.models import PRESETS

    if args.limit < 1:
        raise UsageError(f"--limit must be at least 1, not {args.limit}")
    if args.model and args.model not in PRESETS:
        raise UsageError(f"unknown model preset {args.model!r}; known: {', '.join(PRESETS)}")
    ranked = board(Tracker(TrackingConfig.from_env()), op.name, args.model, args.limit)
    rows = ranked.entries
    n = ranked.fallbacks
    left_out = (f"{n} passed candidate{'s' if n != 1 else ''} flagged reference_fallback left out (PyTorch's "
                f"own {op.name} inside: the speed is torch's)") if n else ""
    if not rows:
        print(f"no passed candidates for {op.name}" + (f" on {args.model}" if args.model else "")
              + (f" ({left_out})" if left_out else ""))
        return 0
    print(f"{'#':>3}  {'score':>7}  {'vs eager':>8}  {'vs compile':>10}  {'%roof':>6}  {'device':<14}  candidate")
    for e in rows:
        fmt = lambda x, suffix="x": f"{x:.2f}{suffix}" if x else "-"
        note = "" if e.gpu_timing else " (interpreter timing)"
        print(f"{e.rank:>3}  {fmt(e.score):>7}  {fmt(e.vs_eager):>8}  {fmt(e.vs_compile):>10}  "
              f"{fmt(e.pct_roofline, '%'):>6}  {e.device[:14]:<14}  {e.label}  [{e.target}]{note}")
    if left_out:
        print(left_out)
    return 0


def cmd_report(args) -> int:
    from tracking.report import report
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    ops = [_op(args.op).name] if args.op else None
    from engine_templates.ops import OPS

    tracker = Tracker(TrackingConfig.from_env())
    for name in ops or list(OPS):
        print(report(tracker, name, gpu_only=not args.include_cpu))
    return 0


def cmd_pool_check(args) -> int:
    from flows.pipeline import jobs_for
    from targets import Target
    from gpu_pool.check import check_host, table

    if not args.stage_timeout > 0:
        raise UsageError(f"--stage-timeout must be more than 0 seconds, not {args.stage_timeout}")
    pool = _pool(args.pool)
    # The bundle check compiles the first op's default template point on the tiny preset.
    from engine_templates.ops import OPS

    op = next(iter(OPS.values()))
    template = next(iter(op.templates.values()))
    probe_target = Target(model="tiny", dtype="fp32")

    def job_for(slot):
        from contract.job import Candidate

        cand = Candidate(op=op.name, kind="template", template=template.name, point=dict(template.default),
                         origin="pool-check")
        return jobs_for(cand, probe_target, slot)["compile"]

    reports = [check_host(h, job_for, args.stage_timeout) for h in pool.hosts]
    print(table(reports))
    return 0 if all(r.ok for r in reports) else 1


def cmd_pool_release(args) -> int:
    from gpu_pool.leases import release_all

    freed = release_all(_pool(args.pool))
    print(f"released {', '.join(freed)}" if freed else "no slot of the pool was held")
    return 0


def cmd_gauntlet(args) -> int:
    from flows.gauntlet import run_gauntlet, table
    from targets import Target
    from gauntlet import load_cases

    if args.op:
        _op(args.op)
    cases = load_cases(args.op)
    if not cases:
        raise UsageError(f"the gauntlet has no cases for {args.op}")
    if args.case:
        cases = [c for c in cases if any(part in c.name for part in args.case)]
        if not cases:
            raise UsageError(f"no gauntlet case{' of ' + args.op if args.op else ''} has "
                             f"{' or '.join(repr(p) for p in args.case)} in its name")
    target = _validated(Target, {"model": args.model, "gpu_class": args.gpu_class,
                                 "budget": {"stage_timeout_s": args.stage_timeout}}, "target")
    _, slots = _pool_with(args.pool, target.gpu_class)
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
    slot = slots[0]
    if slot.gpu is None and any(c.gpu_only for c in cases):
        skipped = [c.name for c in cases if c.gpu_only]
        print(f"gauntlet: not run on {slot.label}, which has no GPU: {', '.join(skipped)}", file=sys.stderr)
        cases = [c for c in cases if not c.gpu_only]
        if not cases:
            raise UsageError(f"every chosen case needs a GPU, and {slot.label} has none")
    print(f"gauntlet: {len(cases)} cases on {slot.label}"
          + (f", {args.jobs} at a time (one bench stage at a time)" if args.jobs > 1 else ""), file=sys.stderr)

    rows = []

    def progress(row):
        rows.append(row)
        gate = row.verdict.failing_gate
        why = f" — {gate.detail}" if not row.ok and gate is not None and gate.detail else ""
        print(f"  {'ok ' if row.ok else 'BAD'} {row.case.name}: expected {row.case.expected}, got {row.got}{why} "
              f"[{len(rows)}/{len(cases)}]", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="infersmith-gauntlet-") as root:
        executor = None
        if slot.host.is_local:
            # The cases run from a copy of the worker packages, as on a pool host: the one that
            # writes into the harness touches that copy, not this checkout.
            from gpu_pool.bundle import current_bundle, unpack
            from gpu_pool.local import LocalExecutor

            executor = LocalExecutor(worker_root=unpack(current_bundle(), Path(root)))
        try:
            rows = run_gauntlet(cases, target, slot, progress, jobs=args.jobs, executor=executor)
        except KeyboardInterrupt:  # the cases that finished are still a result: print them
            print(table(rows, on_gpu=slot.gpu is not None))
            print(f"\ninterrupted after {len(rows)} of {len(cases)} cases")
            raise
    print(table(rows, on_gpu=slot.gpu is not None))
    return 0 if all(r.ok for r in rows) else 1


def _serve_target(args, candidates: int = 1, wall_clock: float = 3600.0):
    """The target with its serving settings: the preset's, a --serving file over them, then options."""
    import yaml

    from targets import Serving
    from contract.serve import BASELINE_ENGINES as ENGINES

    target = _target(args, candidates, wall_clock)
    serving = target.serving.model_dump()
    if args.serving:
        try:
            loaded = yaml.safe_load(Path(args.serving).read_text())
        except OSError as e:
            raise UsageError(f"cannot read serving file {args.serving}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"{args.serving}: not a text file (not UTF-8)") from None
        except yaml.YAMLError as e:
            raise UsageError(f"{args.serving}: not valid YAML or JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"{args.serving}: expected a mapping of serving settings (traffic, accuracy, ...)")
        serving |= loaded
    if args.baseline:
        serving["baseline"] = args.baseline
    if args.margin is not None:
        serving["margin"] = args.margin
    checked = _validated(Serving, serving, "serving settings")
    if args.patterns:
        known = [p.name for p in checked.traffic]
        unknown = sorted(set(args.patterns) - set(known))
        if unknown:
            raise UsageError(f"no traffic pattern {', '.join(unknown)}; the target has {', '.join(known)}")
        checked = checked.model_copy(update={"traffic": [p for p in checked.traffic if p.name in args.patterns]})
    if checked.baseline != "reference" and checked.baseline not in ENGINES:
        _check_command(checked.baseline, "--baseline" if args.baseline else f"{args.serving}: baseline")
    return target.model_copy(update={"serving": checked})


SERVER_PLACEHOLDERS = ("port", "model_dir", "name", "replica")


def _check_command(command: str, what: str) -> None:
    """A server command is filled in and split as the end-to-end stage will (harness/serve/stage.py,
    command_argv): a mistake there is a usage error now, not a crash after the reference ran."""
    known = ", ".join(f"{{{p}}}" for p in SERVER_PLACEHOLDERS)
    try:
        filled = command.format(port=8000, model_dir="/model", name="model", replica=0)
    except KeyError as e:
        raise UsageError(f"{what}: unknown placeholder {{{e.args[0]}}} in {command!r}; known: {known}") from None
    except (IndexError, AttributeError, ValueError) as e:
        raise UsageError(f"{what}: cannot fill in {command!r} ({e}); placeholders: {known}, "
                         "and a literal brace is written {{ or }}") from None
    try:
        argv = shlex.split(filled)
    except ValueError as e:
        raise UsageError(f"{what}: {command!r} cannot be split like a shell line: {e}") from None
    if not argv:
        raise UsageError(f"{what}: the command is empty")


def _model_dir(path: str) -> Path:
    d = Path(path)
    if not (d / "config.json").is_file() or not (d / "tokenizer.json").is_file():
        raise UsageError(f"not a model directory (config.json and tokenizer.json): {path}")
    return d.resolve()


def _serve_place(args, target):
    """The pool and the model directory, refused at once when no host can run the target's
    replicas. Where a slot is this machine the directory is checked here; a pool host is asked
    before the run whether it has the directory (a path there: no checkpoint is shipped), aiperf,
    torch, transformers and aiohttp, so that a lack is one line, not a crash. A baseline named by
    engine (vllm, sglang) is asked of every host, this machine included: its python must import it."""
    from gpu_pool.check import serve_problems
    from contract.serve import BASELINE_ENGINES as ENGINES

    pool, slots = _pool_with(args.pool, target.gpu_class)
    problem = pool.group_problem(target.gpu_class, target.serving.replicas)
    if problem:
        raise UsageError(f"serving.replicas: {problem}")
    if any(s.host.is_local for s in slots):
        model_dir = str(_model_dir(args.model_dir))
    elif not Path(args.model_dir).is_absolute():
        raise UsageError(f"--model-dir must be an absolute path on the pool hosts, not {args.model_dir}")
    else:
        model_dir = args.model_dir
    engine = target.serving.baseline in ENGINES
    hosts = {s.host.name: s.host for s in slots if engine or not s.host.is_local}
    lacks = [f"host {name}: {line}" for name, host in hosts.items()
             for line in serve_problems(host, model_dir, target.serving.baseline)]
    if lacks:
        raise UsageError("; ".join(lacks))
    return pool, model_dir


def _kernels(path: str | None) -> dict:
    """A kernels file as the engine reads it (relative paths resolved), back to its JSON form."""
    if not path:
        return {}
    from engine_templates.engine.config import EngineSetupError
    from engine_templates.engine.kernels import parse_kernels_file

    try:
        specs = parse_kernels_file(Path(path))
    except EngineSetupError as e:
        raise UsageError(str(e)) from None
    return {op: {k: v for k, v in vars(spec).items() if v} for op, spec in specs.items()}


def _serve_errors():
    from gpu_pool.health import HostFault
    from gpu_pool.ssh_serve import ServeSetupError
    from contract.serve import AIPerfError
    from contract.serve import ServerError

    # HostFault: every host of the pool failed (the dispatch retried on the others first)
    return AIPerfError, ServerError, ServeSetupError, HostFault


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def cmd_serve_bench(args) -> int:
    target = _serve_target(args)
    if args.candidate is not None:
        _check_command(args.candidate, "--candidate")
    kernels = _kernels(args.kernels)
    pool, model_dir = _serve_place(args, target)
    from flows.optimize_engine import serve_bench

    _open_store()
    try:
        result = serve_bench(model_dir, target, kernels, args.candidate, pool)
    except _serve_errors() as e:
        print(f"infersmith: serve-bench could not run: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        rows = [["pattern", "metric", "better", "candidate", "baseline", "vs baseline"]]
        rows += [[r["pattern"], r["metric"], r["better"], _fmt(r["candidate"]), _fmt(r["baseline"]),
                  "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3g}x"] for r in result["table"]]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        for g in result["gates"]:
            print(f"{g['name']}: {'ok' if g['passed'] else 'FAILED'}  {g['detail']}")
        print(f"verdict: {result['line']}  (MLflow run {result['run_id']})")
    return 0 if result["verdict"] == "pass" else 1


def cmd_optimize_engine(args) -> int:
    if args.kernels_per_op < 0:
        raise UsageError(f"--kernels-per-op must be at least 0 (0: every op eager), not {args.kernels_per_op}")
    target = _serve_target(args, args.budget, args.wall_clock)
    include = [{"kernels": _kernels(k)} for k in args.include or []]
    pool, model_dir = _serve_place(args, target)
    from flows.optimize_engine import optimize_engine

    _open_store()
    try:
        result = optimize_engine(model_dir, target, args.seed, args.kernels_per_op, include, pool,
                                 proposer=args.proposer)
    except _serve_errors() as e:
        print(f"infersmith: optimize-engine stopped: {e}", file=sys.stderr)
        return 1
    return 0 if result["candidates"] else 1


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, help="HF-format checkpoint directory the servers load "
                                                       "(with --pool: a path on the pool hosts)")
    p.add_argument("--baseline", help='the server to beat: "reference" (default: the HF transformers reference '
                                      'server), "vllm", "sglang" (that engine\'s server, which the python '
                                      'running the servers must import), or a command with {port}, '
                                      '{model_dir}, {name}, {replica}')
    p.add_argument("--serving", help="YAML or JSON file of serving settings (traffic, accuracy, margin, baseline)")
    p.add_argument("--patterns", type=lambda t: [x for x in t.split(",") if x],
                   help="only these traffic patterns, comma-separated")
    p.add_argument("--margin", type=float, help="every metric must beat the baseline by this fraction (default 0.02)")
    p.add_argument("--pool", help="pool.yaml (default: this machine)")
    _add_target_options(p, kernel=False)


def cmd_engine(args) -> int:
    """`infersmith engine generate|serve` (engine_templates/engine/cli.py); a bad model
    directory or kernels file is a usage error."""
    from engine_templates.engine.config import EngineSetupError

    try:
        return args.engine_fn(args)
    except EngineSetupError as e:
        raise UsageError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="infersmith", description="LLM-inference optimization that cannot be gamed.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("ops", help="list the ops, their signatures and templates").set_defaults(fn=cmd_ops)

    e = sub.add_parser("evaluate", help="run one candidate file through compile, check and microbench")
    e.add_argument("--op", required=True)
    e.add_argument("--candidate", required=True, help="Python file defining a function named after the op")
    e.add_argument("--json", action="store_true", help="print the verdict as JSON")
    e.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    _add_target_options(e)
    e.set_defaults(fn=cmd_evaluate)

    o = sub.add_parser("optimize", help="search an op's template space for the target")
    o.add_argument("--op", required=True)
    o.add_argument("--budget", type=int, default=16, help="candidates to evaluate (default 16)")
    o.add_argument("--proposer", choices=["random", "tpe"], default="tpe")
    o.add_argument("--template", help="template to search (default: the op's first)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--wall-clock", type=float, default=3600.0, help="seconds before proposing stops")
    o.add_argument("--plateau", type=int, default=24, help="stop after N candidates without a 1%% gain")
    o.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    _add_target_options(o)
    o.set_defaults(fn=cmd_optimize)

    lb = sub.add_parser("leaderboard", help="passed candidates of an op, best first")
    lb.add_argument("--op", required=True)
    lb.add_argument("--model", help="only this model preset")
    lb.add_argument("--limit", type=int, default=20, help="rows shown, at least 1 (default 20)")
    lb.set_defaults(fn=cmd_leaderboard)

    r = sub.add_parser("report", help="markdown tables of the best candidate per shape vs eager and compile")
    r.add_argument("--op", help="only this op (default: every op)")
    r.add_argument("--include-cpu", action="store_true", help="include interpreter-timed runs")
    r.set_defaults(fn=cmd_report)

    g = sub.add_parser("gauntlet", help="run the red-team and honest suites; print a markdown table")
    g.add_argument("--op", help="only this op's cases (default: every op)")
    g.add_argument("--pool", help="pool.yaml (default: this machine); runs on the first slot")
    g.add_argument("--gpu-class", default="any", help=f"use a slot of this class ({_gpu_classes()})")
    g.add_argument("--model", default="tiny", help="model preset for the shapes (default tiny)")
    g.add_argument("--stage-timeout", type=float, default=300.0, help="seconds one stage may run")
    g.add_argument("--case", action="append", help="only cases whose name (op/file or op/template[point]) "
                   "contains this; repeatable")
    g.add_argument("--jobs", type=int, default=1, help="cases at once on the slot; their bench stages still "
                   "run one at a time (default 1)")
    g.set_defaults(fn=cmd_gauntlet)

    pl = sub.add_parser("pool", help="the GPU hosts of a pool.yaml: check them, free their leases")
    pool_sub = pl.add_subparsers(dest="pool_command", required=True, parser_class=_Parser)
    pc = pool_sub.add_parser("check", help="connect to every host: GPUs, driver, torch, triton, does the bundle run")
    pc.add_argument("--pool", help="pool.yaml (default: this machine)")
    pc.add_argument("--stage-timeout", type=float, default=300.0, help="seconds the bundle check may run "
                                                                       "(default 300)")
    pc.set_defaults(fn=cmd_pool_check)
    pr = pool_sub.add_parser("release", help="free every GPU lease of the pool (after a killed flow, "
                                             "on a Prefect API without a server)")
    pr.add_argument("--pool", help="pool.yaml (default: this machine)")
    pr.set_defaults(fn=cmd_pool_release)

    sb = sub.add_parser("serve-bench", help="serve the engine (or a command's server) and the baseline under "
                                            "AIPerf; print the side-by-side table")
    sb.add_argument("--kernels", help="kernels file for the engine (default: every op eager)")
    sb.add_argument("--candidate", help="judge the server this command starts instead of the engine "
                                        "({port}, {model_dir}, {name}, {replica} are filled in)")
    sb.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_serve_options(sb)
    sb.set_defaults(fn=cmd_serve_bench)

    oe = sub.add_parser("optimize-engine", help="search engine configurations end to end against the baseline")
    oe.add_argument("--budget", type=int, default=8, help="configurations to evaluate (default 8)")
    oe.add_argument("--proposer", choices=["random", "tpe"], default="tpe")
    oe.add_argument("--seed", type=int, default=0)
    oe.add_argument("--kernels-per-op", type=int, default=2,
                    help="best GPU-timed leaderboard kernels offered per op besides eager (default 2; "
                         "0: every op eager, only the engine's knobs searched)")
    oe.add_argument("--include", action="append", help="a kernels file to try first (repeatable)")
    oe.add_argument("--wall-clock", type=float, default=3600.0, help="seconds before proposing stops")
    _add_serve_options(oe)
    oe.set_defaults(fn=cmd_optimize_engine)

    about = ("the LLM engine: generate, serve (an OpenAI-compatible API), serve-reference (HF transformers), "
             "bench, profile, random-checkpoint")
    en = sub.add_parser("engine", help=about, description=about[0].upper() + about[1:] + ".")
    from engine_templates.engine.cli import add_commands

    add_commands(en.add_subparsers(dest="engine_command", required=True, parser_class=_Parser))
    en.set_defaults(fn=cmd_engine)
    return p


def main(argv: list[str] | None = None) -> int:
    # Prefect's telemetry writes to its database while the ephemeral server starts: off.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "WARNING")
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "budget", 1) < 1:
            raise UsageError("--budget must be at least 1")
        return args.fn(args)
    except UsageError as e:
        print(f"infersmith: {e}", file=sys.stderr)
        return USAGE_ERROR
    except TrackingStoreError as e:
        print(f"infersmith: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        url = _prefect_unreachable(e)
        if url is None:
            raise
        print(f"infersmith: the Prefect server at {url} is unreachable: start it (`prefect server start`), "
              "or unset PREFECT_API_URL to run on an ephemeral one", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infersmith: interrupted; finished candidates are in MLflow", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
