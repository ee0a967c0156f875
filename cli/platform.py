"""`infersmith deploy`, `up`, `down` and `sweep`: the team platform's commands."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from cli.args import UsageError, open_store, pool_of

DEFAULT_SWEEP = Path(__file__).resolve().parent.parent / "infra" / "sweep.yaml"
NIGHTLY = "0 2 * * *"  # the sweep's default schedule: 02:00 in the schedule's time zone


def _home() -> Path:
    return Path(os.environ.get("INFERSMITH_HOME", ".infersmith")).resolve()


@contextmanager
def using_stack(command: str):
    """While a command other than up and down runs: the stack `infersmith up` runs for this tracking
    home, unless PREFECT_API_URL names a server already. Its runs then show in both UIs."""
    from cli.stack import environment, running

    record = None if command in ("up", "down") or os.environ.get("PREFECT_API_URL") else running(_home())
    if record is None:
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = environment(record)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if k != "PREFECT_API_URL" and not os.environ.get(k)})
    try:
        # Prefect read its settings when imported: the API URL is given to it as a setting
        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _plan(path: str):
    from flows.sweep import SweepFileError, load_plan

    try:
        return load_plan(path)
    except SweepFileError as e:
        raise UsageError(str(e)) from None


def _deploy_settings(args):
    """The deployments' settings from the options, every one checked here; and whether the sweep's
    schedule was asked for (else a schedule the server has, edited or paused in the UI, is kept)."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    from prefect.schedules import Cron

    from flows.deployments import DeploySettings

    cron, timezone = args.cron or NIGHTLY, args.timezone or "UTC"
    try:
        Cron(cron)
    except ValueError as e:
        raise UsageError(f"--cron {cron!r}: {str(e).splitlines()[0]}") from None
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise UsageError(f"--timezone {timezone!r} is not an IANA time zone (e.g. UTC, Europe/Paris)") from None
    pool = pool_of(args.pool) if args.pool else None  # (pool_of(None) is this machine)
    # The default plan is an example: its schedule is registered paused; a named plan's runs.
    settings = DeploySettings(plan=_plan(args.sweep or DEFAULT_SWEEP), work_pool=args.work_pool, cron=cron,
                              timezone=timezone, active=bool(args.sweep) and not args.paused, pool=pool)
    return settings, any((args.sweep, args.paused, args.cron, args.timezone))


def _print_deployed(names: list[str], settings, ui: str) -> None:
    from flows.deployments import sweep_schedule

    for name in names:
        print(f"deployment {name} on work pool {settings.work_pool}")
    print(f"sweep schedule: {sweep_schedule(settings)} (edit, pause or resume it in the UI)")
    print(f"launch them from {ui}/deployments")


def cmd_deploy(args) -> int:
    from prefect.settings import get_current_settings

    from flows.deployments import register

    api = get_current_settings().api.url
    if not api:
        raise UsageError("deploy registers deployments on a Prefect server: set PREFECT_API_URL, or run `infersmith up`")
    settings, explicit = _deploy_settings(args)
    names = register(settings, schedule=explicit)
    _print_deployed(names, settings, api.rstrip("/").removesuffix("/api"))
    return 0


def _stack_settings(args):
    from cli.stack import StackSettings

    for what, port in (("--prefect-port", args.prefect_port), ("--mlflow-port", args.mlflow_port)):
        if not 1 <= port <= 65535:
            raise UsageError(f"{what} must be a port number (1-65535), not {port}")
    for what, url in (("--prefect-database", args.prefect_database), ("--mlflow-database", args.mlflow_database)):
        if url and url.split(":", 1)[0].split("+")[0] not in ("sqlite", "postgresql"):
            raise UsageError(f"{what}: expected a postgresql:// or sqlite:/// URL")
    return StackSettings(home=_home(), host=args.host, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port,
                         prefect_database=args.prefect_database, mlflow_database=args.mlflow_database,
                         artifacts=args.artifacts, work_pool=args.work_pool)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (from `infersmith down`) stops the stack as Ctrl-C does


def cmd_up(args) -> int:
    from cli.stack import PortInUse, Stack, StackError, check_ports, running

    s = _stack_settings(args)
    if running(s.home):
        raise UsageError(f"a stack already runs for {s.home} (its record: {s.home / 'stack.json'}): "
                         "`infersmith down` first")
    try:
        check_ports(s)
    except PortInUse as e:
        raise UsageError(str(e)) from None
    # the slower checks (the flows' imports: torch, Prefect, MLflow) after the quick ones
    from flows.deployments import register
    from object_store import S3Location
    from object_store.s3 import S3Store

    if s.s3:
        try:
            S3Store(S3Location.parse(s.s3)).check()  # ObjectStoreError: one line, exit 1
        except ValueError as e:
            raise UsageError(f"--artifacts: {e}") from None
    deploy, explicit = _deploy_settings(args)

    from prefect.settings import PREFECT_API_URL, temporary_settings

    def registered(api: str) -> list[str]:
        with temporary_settings({PREFECT_API_URL: api}):
            return register(deploy, schedule=explicit)

    def online(api: str, worker: str) -> bool:
        from prefect.client.orchestration import get_client

        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            return any(w.name == worker and w.status == "ONLINE" for w in client.read_workers_for_work_pool(s.work_pool))

    stack = Stack(s)
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell starts background jobs ignoring it
        signal.signal(sig, _interrupt)
    print(f"starting the Prefect and MLflow servers (logs in {s.home / 'logs'}) ...", file=sys.stderr, flush=True)
    try:
        names = stack.up(registered, online)  # stops what it started before it raises
    except StackError as e:
        print(f"infersmith: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infersmith: interrupted while starting; what had started is stopped", file=sys.stderr)
        return 130
    with temporary_settings({PREFECT_API_URL: s.prefect_api}):
        _print_deployed(names, deploy, s.prefect_ui)
    from tracking.mlflow_ui import experiments_url

    print(f"Prefect UI: {s.prefect_ui}\nMLflow UI:  {experiments_url(s.mlflow_ui)}\n"
          f"a worker of work pool {s.work_pool} runs their flows; Ctrl-C or `infersmith down` stops them",
          flush=True)
    code = 0
    try:
        gone = stack.watch()
        print(f"infersmith: the {gone} exited (see {s.home / 'logs' / gone}.log); stopping the others",
              file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        pass
    finally:
        with _ignoring(signal.SIGINT):  # a second Ctrl-C must not leave half the stack running
            stack.down()
    print("stopped", file=sys.stderr)
    return code


@contextmanager
def _ignoring(sig):
    old = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(sig, old)


def cmd_down(args) -> int:
    from cli.stack import stop_recorded

    stopped = stop_recorded(_home())
    print(f"stopped {', '.join(stopped)}" if stopped else f"nothing to stop: no stack recorded in {_home()}")
    return 0


def cmd_sweep(args) -> int:
    from flows.sweep import sweep

    plan = _plan(args.file)
    if args.max_gpu_hours is not None:
        if args.max_gpu_hours <= 0:
            raise UsageError(f"--max-gpu-hours must be more than 0, not {args.max_gpu_hours:g}")
        plan = plan.model_copy(update={"max_gpu_hours": args.max_gpu_hours})
    pool = pool_of(args.pool) if args.pool else None
    open_store()
    state = sweep(plan, pool, return_state=True)
    if not state.is_completed():
        print(f"infersmith: sweep failed: {state.message}", file=sys.stderr)
        return 1
    return 0


def _add_deploy_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployments (the sweep's schedule, when none of --sweep, --cron, --timezone, "
                             "--paused is given, stays as the server has it)")
    g.add_argument("--work-pool", default="infersmith", help="the process work pool they run on (default infersmith; "
                   "another, e.g. infersmith-h100, gets deployments of its own: optimize-op-h100, ...)")
    g.add_argument("--sweep", help="the sweep deployment's plan, a YAML file; its schedule is then active "
                                   "(default: infra/sweep.yaml, registered paused)")
    g.add_argument("--cron", help=f"the sweep's schedule (default {NIGHTLY!r})")
    g.add_argument("--timezone", help="the schedule's IANA time zone (default UTC)")
    g.add_argument("--paused", action="store_true", help="register the sweep's schedule paused")
    g.add_argument("--pool", help="pool.yaml: the deployments' default GPU pool (default: the worker's machine)")


def add_commands(sub) -> None:
    d = sub.add_parser("deploy", help="register the deployments on the Prefect server of PREFECT_API_URL")
    _add_deploy_options(d)
    d.set_defaults(fn=cmd_deploy)

    u = sub.add_parser("up", help="start a Prefect server, an MLflow server and a worker here; register "
                                  "the deployments; Ctrl-C stops them")
    u.add_argument("--host", default="127.0.0.1", help="the address both servers listen on (default 127.0.0.1)")
    u.add_argument("--prefect-port", type=int, default=4200, help="default 4200")
    u.add_argument("--mlflow-port", type=int, default=5000, help="default 5000")
    u.add_argument("--prefect-database", help="postgresql://... (default: SQLite under the tracking home)")
    u.add_argument("--mlflow-database", help="postgresql://... (default: the tracking home's mlflow.db)")
    u.add_argument("--artifacts", help="s3://bucket/prefix for MLflow's artifacts and the results archives "
                                       "(default: the tracking home's artifacts/)")
    _add_deploy_options(u)
    u.set_defaults(fn=cmd_up)

    sub.add_parser("down", help="stop what `infersmith up` started, from any terminal").set_defaults(fn=cmd_down)

    s = sub.add_parser("sweep", help="run a sweep plan once: every op on every target, as subflows")
    s.add_argument("file", help="the plan, a YAML file (see infra/sweep.yaml)")
    s.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    s.add_argument("--max-gpu-hours", type=float, help="the sweep's GPU-hours in all (over the plan's "
                                                       "max_gpu_hours): no optimization starts past them")
    s.set_defaults(fn=cmd_sweep)

