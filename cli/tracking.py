"""What tracking holds, for people: leaderboard (an op's or the engine's) and report, each with what
finding its winners cost."""
from __future__ import annotations

from cli.args import UsageError, op_named

ENGINE = "engine"  # `--op engine`: engine configurations, the end-to-end stage's candidates


def _fmt(x: float | None, suffix: str = "x") -> str:
    return f"{x:.2f}{suffix}" if x else "-"


def _money(x: float) -> str:
    return f"{x:.3g}" if x else "0"


def cost_lines(tracker, op: str, scopes: list[tuple[str, str]], best_of) -> list[str]:
    """Per (target, GPU class) shown: candidates, GPU-hours and $ spent finding them (with the
    end-to-end stage's reference and baseline), and $ and GPU-hours per percent gained."""
    from tracking.cost import per_gain_text, spent

    out = []
    for target, gpu_class in dict.fromkeys(scopes):
        cost, n = spent(tracker, op, target, gpu_class or None)
        out.append(f"spent on {target} ({gpu_class or 'any class'}): {n} candidate{'s' if n != 1 else ''}, "
                   f"{cost.text()}; "
                   f"{per_gain_text(cost, best_of(target, gpu_class))}")
    return out


def cmd_leaderboard(args) -> int:
    from tracking.history import board, engine_board
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    op = args.op if args.op == ENGINE else op_named(args.op).name
    if args.limit < 1:
        raise UsageError(f"--limit must be at least 1, not {args.limit}")
    if args.model:
        from targets.model import model_name

        try:
            args.model = model_name(args.model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    tracker = Tracker(TrackingConfig.from_env())
    if op == ENGINE:
        return _engine_leaderboard(tracker, engine_board(tracker, args.limit, args.model), args.model)
    from tracking.mlflow_ui import COMPARED, compare_best

    ranked = board(tracker, op, args.model, args.limit)
    rows = ranked.entries
    n = ranked.fallbacks
    left_out = (f"{n} passed candidate{'s' if n != 1 else ''} flagged reference_fallback left out (PyTorch's "
                f"own {op} inside: the speed is torch's)") if n else ""
    if not rows:
        print(f"no passed candidates for {op}" + (f" on {args.model}" if args.model else "")
              + (f" ({left_out})" if left_out else ""))
        return 0
    print(f"{'#':>3}  {'score':>7}  {'held-out':>8}  {'vs eager':>8}  {'vs compile':>10}  {'%roof':>6}  {'GPU-h':>7}  "
          f"{'$':>7}  {'device':<14}  candidate  [target]  run")
    for e in rows:
        note = "" if e.gpu_timing else " (interpreter timing)"
        held = _fmt(e.held_out) if e.held_out_status == "pass" else e.held_out_status or "-"
        print(f"{e.rank:>3}  {_fmt(e.score):>7}  {held:>8}  {_fmt(e.vs_eager):>8}  {_fmt(e.vs_compile):>10}  "
              f"{_fmt(e.pct_roofline, '%'):>6}  {e.gpu_hours:>7.3g}  {_money(e.total_usd):>7}  {e.device[:14]:<14}  "
              f"{e.label}  [{e.target}]{note}  {e.run_id}")
    if left_out:
        print(left_out)
    print(f"compare the best {min(len(rows), COMPARED)} side by side in MLflow: "
          f"{compare_best(tracker.cfg, tracker.experiment(op), [e.run_id for e in rows])}")

    def best(target: str, gpu_class: str) -> float | None:
        top = board(tracker, op, limit=1, target=target, gpu_class=gpu_class or None).entries
        return top[0].score if top else None

    for line in cost_lines(tracker, op, [(e.target, e.gpu_class) for e in rows], best):
        print(line)
    return 0


def _engine_leaderboard(tracker, rows, model: str | None) -> int:
    from tracking.history import engine_board

    if not rows:
        print("no passed engine configurations" + (f" on {model}" if model else ""))
        return 0
    print(f"{'#':>3}  {'score':>7}  {'worst':>7}  {'GPU-h':>7}  {'$':>7}  {'device':<14}  configuration  [target]  run")
    for e in rows:
        print(f"{e.rank:>3}  {_fmt(e.score):>7}  {_fmt(e.worst_vs_baseline):>7}  {e.gpu_hours:>7.3g}  "
              f"{_money(e.total_usd):>7}  {e.device[:14]:<14}  {e.label}  [{e.target}]  {e.run_id}")

    def best(target: str, gpu_class: str) -> float | None:
        top = engine_board(tracker, 1, target=target, gpu_class=gpu_class or None)
        return top[0].score if top else None

    for line in cost_lines(tracker, ENGINE, [(e.target, e.gpu_class) for e in rows], best):
        print(line)
    return 0


def cmd_report(args) -> int:
    from engine_templates.ops import OPS
    from tracking.report import report
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    ops = [op_named(args.op).name] if args.op else None
    tracker = Tracker(TrackingConfig.from_env())
    for name in ops or list(OPS):
        print(report(tracker, name, gpu_only=not args.include_cpu))
    return 0


def add_commands(sub) -> None:
    """leaderboard, report."""
    lb = sub.add_parser("leaderboard", help="passed candidates of an op (or engine configurations), best first, "
                                            "with their speed-up on held-out shapes where an optimization timed them "
                                            "there, and what finding them cost")
    lb.add_argument("--op", required=True, help="an op (see `infersmith ops`), or `engine`")
    lb.add_argument("--model", help="only this model: a preset, or a config.json or its directory")
    lb.add_argument("--limit", type=int, default=20, help="rows shown, at least 1 (default 20)")
    lb.set_defaults(fn=cmd_leaderboard)

    r = sub.add_parser("report", help="markdown tables of the best candidate per shape vs eager and compile, "
                                      "with what finding them cost")
    r.add_argument("--op", help="only this op (default: every op)")
    r.add_argument("--include-cpu", action="store_true", help="include interpreter-timed runs")
    r.set_defaults(fn=cmd_report)
