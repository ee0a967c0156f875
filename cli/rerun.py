"""Run logged candidates again: reproduce (any one candidate, old and new figures side by side)
and revalidate (today's winners on today's versions; a regression fails the run)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from cli.args import UsageError, gpu_classes, op_named, open_store, pool_of


def _gpu_class(text: str | None) -> str | None:
    from typing import get_args

    from targets import GPUClass

    if text is not None and text not in get_args(GPUClass):
        raise UsageError(f"unknown GPU class {text!r}; known: {gpu_classes()}")
    return text


def _placed(args, old, pool):
    """The GPU class to re-run on and, for an engine configuration, the checkpoint: refused here,
    in one line, when the pool cannot run it."""
    from flows.reproduce import class_for

    try:
        gpu_class = class_for(old, pool, _gpu_class(args.gpu_class))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not old.is_engine:
        return gpu_class, None
    from cli.serve import serve_place

    model_dir = args.model_dir or old.model_dir
    if not model_dir:
        raise UsageError(f"run {old.run_id}'s flow logged no model directory; name it with --model-dir")
    target = old.target.model_copy(update={"gpu_class": gpu_class})
    _, model_dir = serve_place(argparse.Namespace(pool=args.pool, model_dir=model_dir), target)
    return gpu_class, model_dir


def cmd_reproduce(args) -> int:
    from tracking.replay import NotReplayable, logged
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    open_store()
    pool = pool_of(args.pool)
    with tempfile.TemporaryDirectory(prefix="infersmith-reproduce-") as scratch:
        try:  # before any flow starts: an id that names no candidate is a usage error
            old = logged(Tracker(TrackingConfig.from_env()), args.run_id, Path(scratch))
        except NotReplayable as e:
            raise UsageError(str(e)) from None
        gpu_class, model_dir = _placed(args, old, pool)
    from flows.reproduce import RERUN_ERRORS, reproduce

    try:
        result = reproduce(args.run_id, pool, gpu_class, model_dir)
    except RERUN_ERRORS as e:
        print(f"infersmith: reproduce could not run: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        rows = [("figure", "then", "now")] + list(result["table"])
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        print(f"{result['label']} ({result['op']}): run {result['run_id']} then, run {result['new_run_id']} now")
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        same = "the same verdict" if result["same_verdict"] else "ANOTHER verdict"
        print(f"{same}: {result['old_verdict']} then, {result['new_verdict']} now"
              + (f" {result['detail']}" if result["detail"] else ""))
    return 0 if result["same_verdict"] else 1


def cmd_revalidate(args) -> int:
    named = [o for part in args.op or [] for o in part.split(",") if o]
    ops = [op_named(o).name for o in named if o != "engine"]
    if args.model:
        from targets.model import model_name

        try:
            args.model = model_name(args.model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.slack < 0 or args.engine_slack < 0:
        raise UsageError("--slack and --engine-slack are fractions of at least 0 (0.05: 5%)")
    pool = pool_of(args.pool)
    open_store()
    from flows.revalidate import Regressed, revalidate

    try:
        result = revalidate(ops=ops if named else None, model=args.model,
                            gpu_class=_gpu_class(args.gpu_class) or "any",
                            engine=not args.no_engine and (not named or "engine" in named),
                            include_cpu_timed=args.include_cpu,
                            slack=args.slack, engine_slack=args.engine_slack, pool=pool, model_dir=args.model_dir)
        code = 0
    except Regressed as e:
        result, code = e.result, 1
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return code
    for r in result["rows"]:
        print(f"{r['op']}  {r['target']} ({r['gpu_class']})  {r['candidate']}: {r['result']}")
        print(f"    then: {r['then']}  (run {r['run']})")
        if r.get("rerun"):
            print(f"    now:  {r['now']}  (run {r['rerun']})")
    print(f"{result['regressed']} of {result['winners']} winners regressed; {result['rerun']} re-run, "
          f"{result['gpu_hours']:.3g} GPU-h, ${result['total_usd']:.2f}" if result["winners"]
          else "no winner to revalidate (passed, GPU-timed runs; --include-cpu for interpreter-timed ones)")
    return code


def add_commands(sub) -> None:
    """reproduce, revalidate."""
    rp = sub.add_parser("reproduce", help="run one logged candidate (an op's or the engine's) again with its "
                                          "logged target, source or point and rules; print then and now")
    rp.add_argument("run_id", metavar="RUN_ID", help="the candidate's MLflow run id (a child run)")
    rp.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    rp.add_argument("--gpu-class", help=f"run on this GPU class ({gpu_classes()}; default: the class it ran on)")
    rp.add_argument("--model-dir", help="an engine configuration's checkpoint (default: the logged one; with "
                                        "--pool a path on the pool hosts)")
    rp.add_argument("--json", action="store_true", help="print the result as JSON")
    rp.set_defaults(fn=cmd_reproduce)

    rv = sub.add_parser("revalidate", help="run today's winners again on today's torch, triton, CUDA and driver; "
                                           "exit 1 when one regressed")
    rv.add_argument("--op", action="append", help="only these ops' winners, `engine` for the engine's (repeatable "
                                                  "or comma-separated; default: every op and the engine)")
    rv.add_argument("--model", help="only this model's winners: a preset, or a config.json or its directory")
    rv.add_argument("--gpu-class", help=f"only winners of this GPU class ({gpu_classes()})")
    rv.add_argument("--no-engine", action="store_true", help="leave the engine's best configurations out")
    rv.add_argument("--include-cpu", action="store_true", help="also winners timed by the CPU interpreter")
    rv.add_argument("--slack", type=float, default=0.05,
                    help="slowdown an op winner may show beyond its timings' spread (default 0.05: 5%%)")
    rv.add_argument("--engine-slack", type=float, default=0.10,
                    help="how much worse an engine metric or score may get (default 0.10: 10%%)")
    rv.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    rv.add_argument("--model-dir", help="the checkpoint engine configurations serve (default: each one's logged "
                                        "directory)")
    rv.add_argument("--json", action="store_true", help="print the result as JSON")
    rv.set_defaults(fn=cmd_revalidate)
