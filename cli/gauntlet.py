"""`infersmith gauntlet`: the red-team and honest suites through the real stages."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from cli.args import UsageError, gpu_classes, op_named, pool_with, validated


def cmd_gauntlet(args) -> int:
    from flows.gauntlet import run_gauntlet, table
    from gauntlet import load_cases
    from targets import Target

    if args.op:
        op_named(args.op)
    cases = load_cases(args.op)
    if not cases:
        raise UsageError(f"the gauntlet has no cases for {args.op}")
    if args.gpu:
        cases = [c for c in cases if c.on_gpu_check]
        if not cases:
            raise UsageError(f"no gauntlet case of {args.op} is one a GPU checks more of (gpu or gpu_only)")
    if args.case:
        cases = [c for c in cases if any(part in c.name for part in args.case)]
        if not cases:
            raise UsageError(f"no {'GPU ' * args.gpu}gauntlet case{' of ' + args.op if args.op else ''} has "
                             f"{' or '.join(repr(p) for p in args.case)} in its name")
    target = validated(Target, {"model": args.model, "gpu_class": args.gpu_class,
                                 "budget": {"stage_timeout_s": args.stage_timeout}}, "target")
    _, slots = pool_with(args.pool, target.gpu_class)
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
        finally:
            if executor is not None:
                executor.close()  # its fork server imported from the copy, which goes now
    print(table(rows, on_gpu=slot.gpu is not None))
    return 0 if all(r.ok for r in rows) else 1


def add_commands(sub) -> None:
    """gauntlet."""
    g = sub.add_parser("gauntlet", help="run the red-team and honest suites; print a markdown table")
    g.add_argument("--op", help="only this op's cases (default: every op)")
    g.add_argument("--pool", help="pool.yaml (default: this machine); runs on the first slot")
    g.add_argument("--gpu-class", default="any", help=f"use a slot of this class ({gpu_classes()})")
    g.add_argument("--model", default="tiny", help="model preset, or a config.json or its directory, for the "
                   "shapes (default tiny)")
    g.add_argument("--stage-timeout", type=float, default=300.0, help="seconds one stage may run")
    g.add_argument("--case", action="append", help="only cases whose name (op/file or op/template[point]) "
                   "contains this; repeatable")
    g.add_argument("--gpu", action="store_true", help="only the cases a GPU checks more of than a CPU (the "
                   "manifest's gpu_only and gpu cases: the GPU acceptance suite's)")
    g.add_argument("--jobs", type=int, default=1, help="cases at once on the slot; their bench stages still "
                   "run one at a time (default 1)")
    g.set_defaults(fn=cmd_gauntlet)
