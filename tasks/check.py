"""The check stage of one candidate on a leased slot. Every gate on fresh inputs of every shape and seed against the oracle.

Never cached: a re-run must re-measure. Retries belong to the pool (a host that fails is a
different fault from a candidate that fails: gpu_pool.dispatch), so there are none here.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gpu_pool.executors import run_stage

check_stage = task(name="check", cache_policy=NO_CACHE)(run_stage)
