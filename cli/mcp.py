"""`infersmith mcp`: serve the Model Context Protocol on stdio for one target and pool
(cli/mcp_server.py), once both are known to be good."""
from __future__ import annotations

import os
from pathlib import Path

from cli.args import UsageError, add_target_options, open_store, pool_with, target_of


def cmd_mcp(args) -> int:
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

    build_server(target, pool).run("stdio")
    return 0


def add_commands(sub) -> None:
    """mcp."""
    m = sub.add_parser("mcp", help="serve the Model Context Protocol on stdio: an outside agent lists ops, "
                                    "reads an op's description, has candidates judged, reads the leaderboard")
    m.add_argument("--pool", help="pool.yaml of the hosts to run on (default: this machine)")
    m.add_argument("--home", help="tracking home (MLflow store and artifacts; default $INFERSMITH_HOME or "
                                  "./.infersmith; MLFLOW_TRACKING_URI wins over both)")
    add_target_options(m)
    m.set_defaults(fn=cmd_mcp)
