"""The `infersmith` parser and entry point: each command group adds its own commands."""
from __future__ import annotations

import atexit
import os
import sys
import threading

from cli import engine, gauntlet, kb, mcp, op, platform, pool, rerun, serve, tracking
from cli.args import USAGE_ERROR, Parser, UsageError
from flows.api_server import APIServerError
from object_store import ObjectStoreError
from tracking.errors import TrackingStoreError

GROUPS = (op, tracking, rerun, kb, mcp, gauntlet, pool, serve, engine, platform)


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


def build_parser():
    p = Parser(prog="infersmith", description="LLM-inference optimization that cannot be gamed.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for group in GROUPS:
        group.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command; `argv` None: this process is the command itself (the `infersmith` script,
    `python -m cli`), which then ends without tearing its interpreter down (`exit_now`)."""
    code = run(argv)
    if argv is None:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End the process as the interpreter's exit would, less the teardown: threads joined, exit
    handlers run (Prefect's server and the fork servers stopped, logs flushed), output flushed.
    Freeing torch's, MLflow's and Prefect's modules object by object took seconds and leaves
    nothing the end of the process does not."""
    threading._shutdown()  # as the interpreter's exit: its threads' exit hooks (Prefect's log shipping), then the joins
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed, or its reader gone: nothing more can be said through it
    os._exit(code)


def run(argv: list[str] | None) -> int:
    # Prefect's telemetry writes to its database while the ephemeral server starts: off.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "WARNING")
    # reproduce reads a run's artifacts back: no progress bar between its lines
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "budget", 1) < 1:
            raise UsageError("--budget must be at least 1")
        with platform.using_stack(args.command):
            return args.fn(args)
    except UsageError as e:
        print(f"infersmith: {e}", file=sys.stderr)
        return USAGE_ERROR
    except (TrackingStoreError, ObjectStoreError, APIServerError) as e:
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
