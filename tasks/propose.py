"""The propose stage: new candidates from a proposer, given every trial tracking holds."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from contract.job import Candidate
from engine_templates.ops import get_op
from proposers.llm import LLMProposer, Proposal
from tracking.trials import Ceilings, Trial


@task(name="propose", cache_policy=NO_CACHE)
def propose(proposer: str, op: str, template: str, seed: int, history: list[Trial], n: int,
            warm_start: list[dict] | None = None, dtype: str = "bf16") -> list[Candidate]:
    """Up to n new candidates from the proposer, given every trial tracking holds and the points
    published knowledge starts it from; from the template of the op's `dtype` target."""
    from proposers import make_proposer

    template_ = get_op(op, dtype).templates[template]
    return make_proposer(proposer, op, template_, seed, warm_start or ()).propose(history, n)


@task(name="propose-code", cache_policy=NO_CACHE)
def propose_code(proposer: LLMProposer, history: list[Trial], ceilings: Ceilings | None) -> Proposal:
    """One module from the LLM, given every trial tracking holds; its retries are the SDK's."""
    return proposer.propose(history, ceilings)
