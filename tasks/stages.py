"""One Prefect task per pipeline stage. Thin: the work is a call into a domain module."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gpu_pool.executors import run_serve, run_stage
from contract.job import Candidate
from proposers.base import Trial
from engine_templates.ops import get_op


@task(name="propose", cache_policy=NO_CACHE)
def propose(proposer: str, op: str, template: str, seed: int, history: list[Trial], n: int) -> list[Candidate]:
    """Up to n new candidates from the proposer, given every trial tracking holds."""
    from proposers import make_proposer

    return make_proposer(proposer, op, get_op(op).templates[template], seed).propose(history, n)


# Evaluation is never cached: a re-run must re-measure. Retries belong to the pool (a host
# that fails is a different fault from a candidate that fails: gpu_pool.dispatch), so there
# are none here.
compile_stage = task(name="compile", cache_policy=NO_CACHE)(run_stage)
check_stage = task(name="check", cache_policy=NO_CACHE)(run_stage)
microbench_stage = task(name="microbench", cache_policy=NO_CACHE)(run_stage)
STAGE_TASKS = {"compile": compile_stage, "check": check_stage, "bench": microbench_stage}



# The end-to-end stage: servers and AIPerf in subprocesses on the leased slots' host (harness/serve).
serve_stage = task(name="serve", cache_policy=NO_CACHE)(run_serve)
