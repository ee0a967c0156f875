"""`infersmith mcp`: serve the Model Context Protocol on stdio for one target and pool
(cli/mcp_server.py), once both are known to be good."""
from __future__ import annotations

import os
from pathlib import Path

from cli.args import UsageError, add_target_options, open_store, pool_with, target_of


def cmd_mcp(args) -> int:
    if args.max_candidates is not None and args.max_candidates < 1:
        raise UsageError(f"--max-candidates must be at least 1, not {args.max_candidates}")
    if args.max_gpu_hours is not None and args.max_gpu_hours <= 0:
        raise UsageError(f"--max-gpu-hours must be more than 0, not {args.max_gpu_hours:g}")
    target = target_of(args)
    pool, _ = pool_with(args.pool, target.gpu_class)
    if args.home:
        home = Path(args.home)
        try:
            home.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--home {home}: {e.strerror}") from None
        os.environ["INFERSMITH_HOME"] = str(home.resolve())
    open_store()
    from cli.mcp_server import build_server
    from flows.search.stops import SessionBudget

    build_server(target, pool, SessionBudget(args.max_candidates, args.max_gpu_hours)).run("stdio")
    return 0


def add_commands(sub) -> None:
    """mcp."""
    m = sub.add_parser("mcp", help="serve the Model Context Protocol on stdio: an outside agent lists ops, "
                                    "reads an op's description, has candidates judged, reads the leaderboard")
    m.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    m.add_argument("--home", help="tracking home (MLflow store and artifacts; default $INFERSMITH_HOME or "
                                  "./.infersmith; MLFLOW_TRACKING_URI wins over both)")
    m.add_argument("--max-candidates", type=int, help="the session judges at most N candidates; "
                                                      "an evaluate past them is refused with the reason")
    m.add_argument("--max-gpu-hours", type=float, help="the session stops judging before its GPU-hours would pass H")
    add_target_options(m)
    m.set_defaults(fn=cmd_mcp)
