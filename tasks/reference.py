"""The end-to-end stage's reference: the reference server's greedy answers on held-out prompts
(and the baseline's metrics, when the reference is the baseline), measured once per flow."""
from __future__ import annotations

import random
import secrets
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from contract.serve import Reference
from gpu_pool.dispatch import run_leased_group
from gpu_pool.executors import serve_sessions
from gpu_pool.pool import Slot
from targets import Target
from tasks.serve import Baseline, held, job_for
from tracking.ledger import Charge


@task(name="reference", cache_policy=NO_CACHE)
def reference_task(target: Target, model_dir: Path, slots: list[Slot], baseline: Baseline,
                   charge: Charge) -> Reference:
    """The reference server's greedy answers (the held-out prompts drawn from a seed no one sees;
    on a pool host the seed goes with the session and is removed with it), and the baseline's
    metrics when the reference is the baseline; its GPUs' time on `charge`, the flow's."""
    rng = random.Random(secrets.randbits(64))
    reference, runs = run_leased_group(slots, target.serving.replicas,
                                       lambda group: held(charge, "reference", group,
                                                          lambda: serve_sessions(group).reference(
                                                              job_for(target, model_dir, group), baseline.out, rng)))
    baseline.runs = runs
    return reference
