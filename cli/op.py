"""Commands on one op: ops, evaluate, optimize."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cli.args import (
    UsageError,
    add_target_options,
    op_named,
    open_store,
    pool_with,
    prefect_early,
    shapes_fit,
    target_of,
)
from cli.llm import add_llm_options, llm_settings


def cmd_ops(args) -> int:
    from engine_templates.models import ARCHITECTURES, PRESETS
    from engine_templates.ops import OPS
    from engine_templates.vision import ARCH, SAM3_PRESETS

    for op in OPS.values():
        print(f"{op.signature}{'  (vision)' if op.modality == 'vision' else ''}\n    {op.summary}")
        for t in op.templates.values():
            print(f"    template {t.name}: {t.size()} points over {', '.join(t.space)}")
    print("model presets: " + ", ".join(PRESETS))
    print("vision model presets (the vision ops): " + ", ".join(SAM3_PRESETS))
    print("or --model a config.json (or its directory) of: " + ", ".join([*ARCHITECTURES, ARCH]))
    return 0


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


def cmd_evaluate(args) -> int:
    from contract.job import screen_signature

    target = target_of(args)
    pool, slots = pool_with(args.pool, target.gpu_class)
    from gpu_pool.executors import prewarm

    prewarm(slots)  # the stages' fork servers import torch while this process imports its own (the ops')
    op = op_named(args.op, target.dtype)
    shapes_fit(op, target)
    path = Path(args.candidate)
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read candidate {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    problem = screen_signature(source, op.name, op.arg_names)
    if problem:
        raise UsageError(f"{path}: {problem}")
    prefect_ready = prefect_early()
    from flows.evaluate_op import evaluate_candidate

    open_store()
    with prefect_ready():
        result = evaluate_candidate(op=op.name, source=source, target=target, name=path.name, pool=pool)
    verdict = result["verdict"]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(_verdict_text(verdict, result))
    return 0 if verdict["status"] == "pass" else 1


def cmd_optimize(args) -> int:
    target = target_of(args, candidates=args.budget, wall_clock=args.wall_clock, plateau=args.plateau)
    op = op_named(args.op, target.dtype)
    shapes_fit(op, target)
    if args.template and args.template not in op.templates:
        raise UsageError(f"{op.name} has no template {args.template!r}; known: {', '.join(op.templates)}")
    llm = llm_settings(args, target) if args.proposer == "llm" else None
    pool, slots = pool_with(args.pool, target.gpu_class, args.usd_per_gpu_hour)
    if args.warm_start:  # an entry file broken by hand is one line now, not a failed flow later
        from tracking.errors import KnowledgeError
        from tracking.knowledge import KnowledgeBase

        try:
            KnowledgeBase.from_env().entries()
        except KnowledgeError as e:
            raise UsageError(f"{e} (fix it, or start cold with --no-warm-start)") from None
    from gpu_pool.executors import prewarm

    prewarm(slots)
    prefect_ready = prefect_early()
    from flows.optimize_op import optimize_op

    open_store()
    with prefect_ready():
        result = optimize_op(op=op.name, target=target, proposer=args.proposer, template=args.template,
                             seed=args.seed, pool=pool, llm=llm, warm_start=args.warm_start)
    if result["endpoint_down"]:
        print(f"infersmith: proposing stopped: {result['endpoint_down']}; the {int(result['candidates'])} "
              f"candidates judged are in MLflow (run {result['parent_run_id']})", file=sys.stderr)
        return 1
    return 0


def add_commands(sub) -> None:
    """ops, evaluate, optimize."""
    sub.add_parser("ops", help="list the ops, their signatures and templates").set_defaults(fn=cmd_ops)

    e = sub.add_parser("evaluate", help="run one candidate file through compile, check and microbench")
    e.add_argument("--op", required=True)
    e.add_argument("--candidate", required=True, help="Python file defining a function named after the op")
    e.add_argument("--json", action="store_true", help="print the verdict as JSON")
    e.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    add_target_options(e)
    e.set_defaults(fn=cmd_evaluate)

    o = sub.add_parser("optimize", help="search an op's template space, or have an LLM write kernels, for the target")
    o.add_argument("--op", required=True)
    o.add_argument("--budget", type=int, default=16, help="candidates to evaluate (default 16)")
    o.add_argument("--proposer", choices=["random", "tpe", "llm"], default="tpe",
                   help="random or tpe: search the template's space; llm: a model writes free candidates")
    o.add_argument("--template", help="template to search (default: the op's first)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--wall-clock", type=float, default=3600.0, help="seconds before proposing stops")
    o.add_argument("--plateau", type=int, default=24, help="stop after N candidates without a 1%% gain")
    o.add_argument("--max-tokens-total", type=int, help="stop before the proposer's tokens would pass N")
    o.add_argument("--max-usd", type=float, help="stop before the dollars spent (tokens and GPU time) would pass X")
    o.add_argument("--max-gpu-hours", type=float, help="stop before the GPU-hours held would pass H")
    o.add_argument("--usd-per-gpu-hour", type=float, help="this run's price of a GPU-hour (default: the pool "
                                                          "file's, else the shipped price of the GPU class)")
    o.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    o.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                   help="start cold: not from the winners of other targets' published knowledge entries")
    add_target_options(o)
    add_llm_options(o)
    o.set_defaults(fn=cmd_optimize)
