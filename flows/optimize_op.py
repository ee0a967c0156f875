"""optimize_op: propose -> compile -> check -> microbench, until the budget or a plateau."""
from __future__ import annotations

from typing import Literal

from prefect import flow

from engine_templates.ops import OPS
from flows.search import Progress, run_search
from flows.search.op import OpSession, scope_for
from flows.search.publish import publish_op, time_on_held_out
from gpu_pool.pool import Pool
from proposers.llm import LLMSettings
from targets import Target

ProposerName = Literal["random", "tpe", "llm"]
# The op parameter's type: the Prefect UI offers the ops as choices and refuses any other name.
OpName = Literal[tuple(OPS)]
__all__ = ["OpName", "Progress", "ProposerName", "optimize_op", "scope_for"]


@flow(name="optimize-op", log_prints=True)
def optimize_op(op: OpName = "rmsnorm", target: Target = Target(), proposer: ProposerName = "tpe",
                template: str | None = None, seed: int = 0, pool: Pool | None = None,
                llm: LLMSettings | None = None, warm_start: bool = True) -> dict:
    """Optimize one op for one target: every candidate, passing or not, becomes an MLflow run.
    As many candidates run at once as the pool has free GPUs of the target's class; with the
    `llm` proposer, as many replies are awaited at once as the pool has free slots. With
    `warm_start`, a template search starts from the winners of other targets' published knowledge
    entries; at the end, what the runs taught is written as draft entries for a person."""
    s = OpSession(op, target, proposer, template, seed, pool, llm, warm_start)
    s.start()
    try:
        stopped = run_search(s.search())
        time_on_held_out(s)
    except BaseException as e:
        s.tracker.fail_parent(s.parent, f"{type(e).__name__}: {e}")
        raise
    return publish_op(s, stopped)


if __name__ == "__main__":
    optimize_op(op="rmsnorm", target=Target(model="tiny", budget={"candidates": 8}), proposer="random")
