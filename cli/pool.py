"""`infersmith pool check|release`: the GPU hosts of a pool.yaml."""
from __future__ import annotations

from cli.args import Parser, UsageError, pool_of


def cmd_pool_check(args) -> int:
    from gpu_pool.check import check_host, table
    from targets import Target
    from tasks.evaluate import jobs_for

    if not args.stage_timeout > 0:
        raise UsageError(f"--stage-timeout must be more than 0 seconds, not {args.stage_timeout}")
    pool = pool_of(args.pool)
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

    freed = release_all(pool_of(args.pool))
    print(f"released {', '.join(freed)}" if freed else "no slot of the pool was held")
    return 0


def add_commands(sub) -> None:
    """pool check, pool release."""
    pl = sub.add_parser("pool", help="the GPU hosts of a pool.yaml: check them, free their leases")
    pool_sub = pl.add_subparsers(dest="pool_command", required=True, parser_class=Parser)
    pc = pool_sub.add_parser("check", help="connect to every host: GPUs, driver, torch, triton, does the bundle run")
    pc.add_argument("--pool", help="pool.yaml (default: this machine)")
    pc.add_argument("--stage-timeout", type=float, default=300.0, help="seconds the bundle check may run "
                                                                       "(default 300)")
    pc.set_defaults(fn=cmd_pool_check)
    pr = pool_sub.add_parser("release", help="free every GPU lease of the pool (after a killed flow, "
                                             "on a Prefect API without a server)")
    pr.add_argument("--pool", help="pool.yaml (default: this machine)")
    pr.set_defaults(fn=cmd_pool_release)
