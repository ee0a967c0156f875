"""The compile stage of one candidate on a leased slot. Import the candidate and call it once on every shape: does it load, run and
return the right kind of output.

Never cached: a re-run must re-measure. Retries belong to the pool (a host that fails is a
different fault from a candidate that fails: gpu_pool.dispatch), so there are none here.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gpu_pool.executors import run_stage

compile_stage = task(name="compile", cache_policy=NO_CACHE)(run_stage)
