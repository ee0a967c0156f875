"""Options shared by the command groups, parsed into validated models; every mistake is a
`UsageError`: one line, exit 2."""
from __future__ import annotations

import argparse
import contextlib
import threading
from typing import Callable, ContextManager, Iterator

USAGE_ERROR = 2


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def stage_limit(text: str) -> tuple[str, float]:
    stage, _, seconds = text.partition("=")
    if stage not in ("compile", "check"):
        raise argparse.ArgumentTypeError(f"expected compile=SECONDS or check=SECONDS, got {text!r}")
    try:
        return stage, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds after {stage}=, got {seconds!r}") from None


def gpu_classes() -> str:
    from typing import get_args

    from targets import GPUClassName

    return ", ".join(("any",) + get_args(GPUClassName))


def add_target_options(p: argparse.ArgumentParser, kernel: bool = True) -> None:
    """The target's options; `kernel`: also those only the kernel stages read (shapes, tolerance,
    input sets), which the end-to-end commands do not take."""
    g = p.add_argument_group("target")
    g.add_argument("--model", default="qwen3-8b" if kernel else None,
                   help="model preset (see `infersmith ops`), or a model's config.json or the directory holding it "
                        "(llama, mistral, qwen2, qwen3, qwen3_moe, mixtral; sam3, a vision model); default " +
                        ("qwen3-8b" if kernel else "--model-dir where it is on this machine, else qwen3-8b"))
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp8"], default="bf16",
                   help="fp8: FP8 (e4m3) weights with bf16 activations, judged against the bf16 model"
                        + (" (the ops with an fp8 target: fused_moe, linear)" if kernel else
                           ": the engine's linear layers and experts in FP8 (a bf16 checkpoint quantized at load, "
                           "or an FP8 one)"))
    g.add_argument("--gpu-class", default="any", help=f"run only on this GPU class ({gpu_classes()})")
    if kernel:
        g.add_argument("--decode-batches", type=ints, help="e.g. 1,8,32,128 (default from the preset)")
        g.add_argument("--prefill-tokens", type=ints, help="e.g. 2048,16384")
        g.add_argument("--contexts", type=ints, help="attention context lengths, e.g. 4096,32768")
        g.add_argument("--images", type=ints, help="images per batch of a vision model, e.g. 1,8 (default from "
                                                   "the preset)")
        g.add_argument("--rtol", type=float, help="relative-error tolerance (default per dtype)")
        g.add_argument("--approval-rtol", type=float, help="a looser tolerance: a candidate over --rtol but within "
                       "this waits for a person's approval in the Prefect UI (default: none, it fails)")
        g.add_argument("--approval-timeout", type=float, default=86400.0,
                       help="seconds a candidate waits for approval before it is rejected (default 86400)")
        g.add_argument("--seeds", type=int, default=3, help="random input sets per shape when checking")
        g.add_argument("--stage-limit", action="append", type=stage_limit, default=[], metavar="STAGE=S",
                       help="seconds the compile or the check stage may run, at most --stage-timeout "
                            "(default compile=120, check=180); may be repeated")
    g.add_argument("--stage-timeout", type=float, default=600.0, help="seconds one stage may run")


def validated(model, data: dict, what: str):
    """A pydantic model from options, its first error as a usage error."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"{x}: " for x in [".".join(str(x) for x in err["loc"])] if x)  # none: the whole model's
        raise UsageError(f"bad {what}: {where}{err['msg'].removeprefix('Value error, ')}") from None


def target_of(args, candidates: int = 1, wall_clock: float = 3600.0, plateau: int = 24):
    from targets import TINY_WORKLOAD, Target, Workload, is_tiny

    data = {"model": args.model, "dtype": args.dtype, "gpu_class": args.gpu_class,
            "budget": {"candidates": candidates, "wall_clock_s": wall_clock, "plateau": plateau,
                       "stage_timeout_s": args.stage_timeout,
                       "max_tokens_total": getattr(args, "max_tokens_total", None),
                       "max_usd": getattr(args, "max_usd", None),
                       "max_gpu_hours": getattr(args, "max_gpu_hours", None)}}
    if hasattr(args, "rtol"):  # the kernel options (add_target_options)
        data |= {"rtol": args.rtol, "seeds": args.seeds, "approval_rtol": args.approval_rtol,
                 "approval_timeout_s": args.approval_timeout}
        data["budget"] |= {f"{stage}_timeout_s": seconds for stage, seconds in args.stage_limit}
        workload = {k: getattr(args, k) for k in ("decode_batches", "prefill_tokens", "contexts", "images")
                    if getattr(args, k) is not None}
        if workload:
            base = TINY_WORKLOAD if is_tiny(args.model) else Workload()
            data["workload"] = base.model_dump() | workload
    return validated(Target, data, "target")


def pool_of(path: str | None):
    from gpu_pool.pool_file import PoolFileError, load_pool

    try:
        return load_pool(path)
    except PoolFileError as e:
        raise UsageError(f"bad pool file: {e}") from None


def pool_with(path: str | None, gpu_class: str, usd_per_gpu_hour: float | None = None):
    """The pool and its slots of the class, refused before anything starts when it has none;
    `usd_per_gpu_hour`: this run's price of every GPU-hour (--usd-per-gpu-hour)."""
    if usd_per_gpu_hour is not None and usd_per_gpu_hour < 0:
        raise UsageError(f"--usd-per-gpu-hour must be at least 0, not {usd_per_gpu_hour:g}")
    pool = pool_of(path)
    pool = pool if usd_per_gpu_hour is None else pool.priced(usd_per_gpu_hour)
    slots = pool.slots(gpu_class)
    if not slots:
        has = ", ".join(sorted({h.gpu_class for h in pool.hosts}))
        raise UsageError(f"the pool has no host of GPU class {gpu_class} (its hosts' classes: {has})")
    return pool, slots


def op_named(name: str, dtype: str = "bf16"):
    """The op `name` as a target of `dtype` judges it (for fp8, its fp8 target)."""
    from engine_templates.ops import get_op

    try:
        return get_op(name, dtype)
    except KeyError as e:
        raise UsageError(e.args[0] + (" (--dtype fp8)" if dtype == "fp8" else "")) from None


def shapes_fit(op, target) -> None:
    """An op that cannot take this model (fused_moe on a dense preset, a vision op on a text model, say)
    is a usage error."""
    try:
        target.op_shapes(op)
    except ValueError as e:
        raise UsageError(f"{op.name} on {target.model}: {e}") from None


def prefect_early() -> Callable[[], ContextManager[None]]:
    """Start this command's own Prefect API server now (flows/api_server.py) when no PREFECT_API_URL
    names one and Prefect may start one: its process imports Prefect's server on the other core
    while this one imports the flows and opens the tracking store. Returns the wait for it: a
    context manager for the flow to run in, which raises what starting the server raised.
    Against a server someone runs, the wait does nothing."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return contextlib.nullcontext
    from flows import api_server

    server = api_server.start()
    failed: list[BaseException] = []

    def ready() -> None:
        try:
            server.ready()
        except Exception as e:  # raised again by the wait, in the command's thread
            failed.append(e)

    thread = threading.Thread(target=ready, name="prefect-api-start", daemon=True)
    thread.start()

    @contextlib.contextmanager
    def wait() -> Iterator[None]:
        thread.join()
        if failed:
            raise failed[0]
        with api_server.using(server):
            yield

    return wait


def open_store() -> None:
    """Open the tracking store, and reach the S3 bucket when one is configured, before a flow starts:
    a store this MLflow cannot open or a bucket out of reach is then one line (TrackingStoreError,
    ObjectStoreError, in main) rather than a traceback that Prefect logs from the flow."""
    from object_store import store_from_env
    from tracking.store import TrackingConfig, client

    client(TrackingConfig.from_env())
    store = store_from_env()
    if store is not None:
        store.check()
