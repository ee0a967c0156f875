"""The end-to-end commands: serve-bench and optimize-engine, with the serving options they share."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from cli.args import UsageError, add_target_options, open_store, pool_with, target_of, validated


def _serve_target(args, candidates: int = 1, wall_clock: float = 3600.0, plateau: int = 24):
    """The target with its serving settings: the model's, a --serving file over them, then options."""
    import yaml

    from contract.serve import BASELINE_ENGINES as ENGINES
    from targets import Serving

    if args.model is None:  # the checkpoint served names the model, where this machine can read it
        args.model = args.model_dir if (Path(args.model_dir) / "config.json").is_file() else "qwen3-8b"
    target = target_of(args, candidates, wall_clock, plateau)
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
        image_keys = {"image_size", "prompts_per_image"}
        if any(isinstance(t, dict) and image_keys & set(t) for t in loaded.get("traffic") or []):
            raise UsageError(f"{args.serving} is a serving file of the image stage; {args.model} is a text model")
        serving |= loaded
    if args.baseline:
        serving["baseline"] = args.baseline
    if args.margin is not None:
        serving["margin"] = args.margin
    if args.reference_model_dir:
        serving["reference_model_dir"] = args.reference_model_dir
    checked = validated(Serving, serving, "serving settings")
    if args.patterns:
        known = [p.name for p in checked.traffic]
        unknown = sorted(set(args.patterns) - set(known))
        if unknown:
            raise UsageError(f"no traffic pattern {', '.join(unknown)}; the target has {', '.join(known)}")
        checked = checked.model_copy(update={"traffic": [p for p in checked.traffic if p.name in args.patterns]})
    if checked.baseline != "reference" and checked.baseline not in ENGINES:
        _check_command(checked.baseline, "--baseline" if args.baseline else f"{args.serving}: baseline")
    return target.model_copy(update={"serving": checked})


SERVER_PLACEHOLDERS = ("port", "model_dir", "name", "replica", "python", "max_model_len")


def _check_command(command: str, what: str) -> None:
    """A server command is filled in and split as the end-to-end stage will (harness/serve/stage.py,
    command_argv): a mistake there is a usage error now, not a crash after the reference ran."""
    known = ", ".join(f"{{{p}}}" for p in SERVER_PLACEHOLDERS)
    try:
        filled = command.format(port=8000, model_dir="/model", name="model", replica=0, python="python3",
                                max_model_len=4096)
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


def serve_place(args, target):
    """The pool and the model directory, refused at once when no host can run the target's
    replicas. Where a slot is this machine the directory is checked here; a pool host is asked
    before the run whether it has the directory (a path there: no checkpoint is shipped), aiperf,
    torch, transformers and aiohttp, so that a lack is one line, not a crash. A baseline named by
    engine (vllm, sglang) is asked of every host, this machine included: its python must import it."""
    from contract.serve import BASELINE_ENGINES as ENGINES
    from gpu_pool.check import serve_problems

    pool, slots = pool_with(args.pool, target.gpu_class, getattr(args, "usd_per_gpu_hour", None))
    problem = pool.group_problem(target.gpu_class, target.serving.replicas)
    if problem:
        raise UsageError(f"serving.replicas: {problem}")
    reference = target.serving.reference_model_dir
    if any(s.host.is_local for s in slots):
        model_dir = str(_model_dir(args.model_dir))
        if reference:
            _model_dir(reference)
        _check_fp8(Path(model_dir), reference and Path(reference), target.dtype)
    elif not all(Path(d).is_absolute() for d in (args.model_dir, reference or "/")):
        raise UsageError(f"--model-dir and --reference-model-dir must be absolute paths on the pool hosts, "
                         f"not {args.model_dir}" + (f" and {reference}" if reference else ""))
    else:
        model_dir = args.model_dir
    engine = target.serving.baseline in ENGINES
    hosts = {s.host.name: s.host for s in slots if engine or not s.host.is_local}
    lacks = [f"host {name}: {line}" for name, host in hosts.items()
             for line in serve_problems(host, model_dir, target.serving.baseline)]
    if reference and not lacks:  # the reference's directory must be there too
        lacks = [f"host {name}: {line}" for name, host in hosts.items() if not host.is_local
                 for line in serve_problems(host, reference)]
    if lacks:
        raise UsageError("; ".join(lacks))
    return pool, model_dir


def _check_fp8(model_dir: Path, reference: Path | None, dtype: str) -> None:
    """An FP8 checkpoint is served with --dtype fp8 and judged against its bf16 original; the
    reference is never a quantized checkpoint."""
    def quantized(d: Path) -> bool:
        try:
            return "quantization_config" in json.loads((d / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read {d / 'config.json'}: {e}") from None

    if quantized(model_dir) and dtype != "fp8":
        raise UsageError(f"{model_dir} is an FP8 checkpoint: serve it with --dtype fp8")
    if reference is None and quantized(model_dir):
        raise UsageError(f"{model_dir} is an FP8 checkpoint: name its bf16 original with --reference-model-dir")
    if reference is not None and quantized(reference):
        raise UsageError(f"--reference-model-dir {reference} is a quantized checkpoint; the reference must be bf16")


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


def _image_kernels(path: str) -> None:
    """Refuses a kernels file the SAM 3 engine would refuse (missing, not JSON, an op it has not, a
    free kernel's file missing), in one line, before any server starts."""
    from engine_templates.engine.config import EngineSetupError
    from engine_templates.engine.kernels import parse_kernels_file
    from engine_templates.sam3_engine.ops import SAM3_OPS

    try:
        parse_kernels_file(Path(path), SAM3_OPS)
    except EngineSetupError as e:
        raise UsageError(str(e)) from None


def _serve_errors():
    from contract.serve import AIPerfError, ServerError
    from gpu_pool.health import HostFault
    from gpu_pool.ssh_serve import ServeSetupError

    # HostFault: every host of the pool failed (the dispatch retried on the others first)
    return AIPerfError, ServerError, ServeSetupError, HostFault


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def cmd_serve_bench(args) -> int:
    vision = _vision_target(args)
    if vision is not None:
        return _serve_bench_images(args, vision)
    target = _serve_target(args)
    if args.candidate is not None:
        _check_command(args.candidate, "--candidate")
    kernels = _kernels(args.kernels)
    if args.spec_tokens < 0 or args.spec_ngram < 1:
        raise UsageError(f"--spec-tokens must be at least 0 and --spec-ngram at least 1, not {args.spec_tokens} "
                         f"and {args.spec_ngram}")
    engine = {"spec_tokens": args.spec_tokens, "spec_ngram": args.spec_ngram} if args.spec_tokens else {}
    pool, model_dir = serve_place(args, target)
    from flows.optimize_engine import serve_bench

    open_store()
    try:
        result = serve_bench(model_dir, target, kernels, args.candidate, pool, engine)
    except _serve_errors() as e:
        print(f"infersmith: serve-bench could not run: {e}", file=sys.stderr)
        return 1
    return _print_bench(result, args.json)


def _print_bench(result: dict, as_json: bool) -> int:
    if as_json:
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


def _vision_target(args):
    """The target when --model (or the checkpoint --model-dir names) is a vision model, else None."""
    if args.model is None:  # as _serve_target reads it
        args.model = args.model_dir if (Path(args.model_dir) / "config.json").is_file() else "qwen3-8b"
    target = target_of(args)
    return target if target.modality == "vision" else None


# The text stage's options that the image stage has no use for: (option, set?, why).
TEXT_ONLY = (("--candidate", lambda a: a.candidate is not None, "the image stage serves SAM 3's engine"),
             ("--spec-tokens", lambda a: a.spec_tokens != 0, "speculative decoding is the text engine's"),
             ("--spec-ngram", lambda a: a.spec_ngram != 3, "speculative decoding is the text engine's"),
             ("--baseline", lambda a: a.baseline not in (None, "reference"),
              "the image stage's baseline is the reference server"),
             ("--reference-model-dir", lambda a: a.reference_model_dir is not None,
              "the reference loads --model-dir in fp32"),
             ("--dtype fp8", lambda a: a.dtype == "fp8", "the SAM 3 engine has no FP8 weights"))


def image_settings(args) -> dict:
    """The image stage's serving settings: the defaults (contract/images.py), a --serving file
    (JSON: traffic, accuracy, margin) over them, then --patterns and --margin."""
    from dataclasses import asdict

    from contract.images import PATTERNS, ImageAccuracyRules, serving_file

    try:
        patterns, rules, margin = serving_file(args.serving) if args.serving else (PATTERNS, ImageAccuracyRules(), None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.patterns:
        unknown = sorted(set(args.patterns) - {p.name for p in patterns})
        if unknown:
            raise UsageError(f"no traffic pattern {', '.join(unknown)}; the image stage has "
                             f"{', '.join(p.name for p in patterns)}")
        patterns = tuple(p for p in patterns if p.name in args.patterns)
    margin = args.margin if args.margin is not None else margin if margin is not None else 0.02
    return {"traffic": [asdict(p) for p in patterns], "accuracy": asdict(rules), "margin": margin}


def _serve_bench_images(args, target) -> int:
    """serve-bench for a vision target: the image stage (docs/images.md) on a slot of the pool."""
    for option, given, why in TEXT_ONLY:
        if given(args):
            raise UsageError(f"{option} is an option of the text stage; {target.model} is a vision model ({why})")
    serving = image_settings(args)
    pool, slots = pool_with(args.pool, target.gpu_class)
    if args.kernels:
        _image_kernels(args.kernels)
    model_dir = _image_model_dir(args.model_dir, slots)
    from flows.optimize_engine import serve_bench_images

    open_store()
    try:
        result = serve_bench_images(model_dir, target, serving, args.kernels, pool)
    except _serve_errors() as e:
        print(f"infersmith: serve-bench could not run: {e}", file=sys.stderr)
        return 1
    return _print_bench(result, args.json)


def _image_model_dir(path: str, slots) -> str:
    """The SAM 3 checkpoint the image stage serves: checked here where a slot is this machine; a
    pool host (where it is a path, never shipped) is asked before the run whether it has it, aiperf
    and the servers' modules (`python -m harness.serve check DIR --images`), a lack one line."""
    from gpu_pool.check import serve_problems

    if any(s.host.is_local for s in slots):
        model_dir = _model_dir(path)
        try:
            arch = json.loads((model_dir / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            raise UsageError(f"cannot read {model_dir / 'config.json'}: {e}") from None
        if arch != "sam3":
            raise UsageError(f"{path} holds a {arch} checkpoint, not SAM 3's (model_type sam3)")
    elif not Path(path).is_absolute():
        raise UsageError(f"--model-dir must be an absolute path on the pool hosts, not {path}")
    else:
        model_dir = Path(path)
    hosts = {s.host.name: s.host for s in slots if not s.host.is_local}
    lacks = [f"host {name}: {line}" for name, host in hosts.items()
             for line in serve_problems(host, str(model_dir), images=True)]
    if lacks:
        raise UsageError("; ".join(lacks))
    return str(model_dir)


def cmd_optimize_engine(args) -> int:
    if args.kernels_per_op < 0:
        raise UsageError(f"--kernels-per-op must be at least 0 (0: every op eager), not {args.kernels_per_op}")
    if _vision_target(args) is not None:
        raise UsageError(f"optimize-engine searches the text engine; {args.model} is a vision model "
                         "(serve-bench runs the image stage once)")
    target = _serve_target(args, args.budget, args.wall_clock, args.plateau)
    if args.engine_spec:
        from targets.engine_spec import SpecError, load_spec

        if args.include:
            raise UsageError("--include names kernels files of this project's engine, not of an --engine-spec")
        try:
            load_spec(args.engine_spec)
        except SpecError as e:
            raise UsageError(str(e)) from None
    include = [{"kernels": _kernels(k)} for k in args.include or []]
    pool, model_dir = serve_place(args, target)
    from flows.optimize_engine import optimize_engine

    open_store()
    try:
        result = optimize_engine(model_dir, target, args.seed, args.kernels_per_op, include, pool,
                                 proposer=args.proposer, engine_spec=args.engine_spec)
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
    p.add_argument("--reference-model-dir", help="the checkpoint the reference server loads, when not --model-dir: "
                                                 "an FP8 checkpoint's bf16 original")
    p.add_argument("--pool", help="pool.yaml (default: this machine)")
    add_target_options(p, kernel=False)


def add_commands(sub) -> None:
    """serve-bench, optimize-engine."""
    sb = sub.add_parser("serve-bench", help="serve the engine (or a command's server) and the baseline under "
                                            "AIPerf; print the side-by-side table")
    sb.add_argument("--kernels", help="kernels file for the engine (default: every op eager)")
    sb.add_argument("--candidate", help="judge the server this command starts instead of the engine "
                                        "({port}, {model_dir}, {name}, {replica} are filled in)")
    sb.add_argument("--spec-tokens", type=int, default=0, help="the engine with speculative decoding (prompt "
                                                              "lookup) of this many draft tokens a step (default 0: off)")
    sb.add_argument("--spec-ngram", type=int, default=3, help="the longest n-gram looked up (default 3)")
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
    oe.add_argument("--plateau", type=int, default=24, help="stop after N configurations without a 1%% gain")
    oe.add_argument("--max-usd", type=float, help="stop before the dollars spent on GPU time would pass X")
    oe.add_argument("--max-gpu-hours", type=float, help="stop before the GPU-hours held would pass H")
    oe.add_argument("--usd-per-gpu-hour", type=float, help="this run's price of a GPU-hour (default: the pool "
                                                           "file's, else the shipped price of the GPU class)")
    oe.add_argument("--engine-spec", help="search this server's flags instead of this project's engine: a shipped "
                                          "spec (vllm, sglang, infersmith) or an engine spec file; its defaults are "
                                          "the baseline")
    _add_serve_options(oe)
    oe.set_defaults(fn=cmd_optimize_engine)
