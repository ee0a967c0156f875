"""The microbench stage of one candidate on a leased slot. Time the candidate beside eager and torch.compile on the target's shapes.

Never cached: a re-run must re-measure. Retries belong to the pool (a host that fails is a
different fault from a candidate that fails: gpu_pool.dispatch), so there are none here.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gpu_pool.executors import run_stage

microbench_stage = task(name="microbench", cache_policy=NO_CACHE)(run_stage)
