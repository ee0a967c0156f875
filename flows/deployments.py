"""The deployments a team launches from the Prefect UI, declared here and nowhere else.

`infersmith deploy` (and `infersmith up`) registers them on the Prefect server that
PREFECT_API_URL names, on a process work pool whose workers run them. Each deployment's form is
its flow's typed parameters (the Target, the SweepPlan, the Pool): the UI renders them and the
server refuses a value they do not allow, and a parameter the flow does not have, before any run
starts. A deployment's entry point is a
module path, so a worker runs them wherever infersmith is installed, from any directory.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.schedules import Cron
from prefect.utilities.callables import ParameterSchema
from prefect.workers.process import ProcessWorker

from flows.optimize_engine import optimize_engine
from flows.optimize_op import optimize_op
from flows.revalidate import revalidate
from flows.sweep import SweepPlan, sweep
from gpu_pool.pool import Pool

SCHEDULE_SLUG = "nightly"  # names a nightly schedule, so a redeploy updates it rather than adding one
NIGHTLY = ("sweep", "revalidate")  # the flows deployed on the nightly schedule: the sweep and, beside it, revalidate
DEFAULT_WORK_POOL = "infersmith"


@dataclass(frozen=True)
class DeploySettings:
    plan: SweepPlan  # the sweep deployment's default parameters
    work_pool: str
    cron: str  # the sweep's schedule
    timezone: str  # the schedule's, an IANA name
    active: bool  # whether the schedule runs (it can be paused and resumed in the UI)
    pool: Pool | None = None  # default GPU pool of every deployment; None: the worker's own machine

    def name(self, flow_name: str) -> str:
        """A deployment's name: its flow's on the default work pool; on another, e.g. infersmith-h100
        (the workers of one GPU class), the flow's with the pool's own part: optimize-op-h100."""
        if self.work_pool == DEFAULT_WORK_POOL:
            return flow_name
        return f"{flow_name}-{self.work_pool.removeprefix(DEFAULT_WORK_POOL + '-')}"


class _ClosedParameters(ParameterSchema):
    """A flow's parameter schema that also refuses a parameter the flow does not have."""

    additionalProperties: bool = False


def _closed(d: RunnerDeployment) -> RunnerDeployment:
    """`d` with its form closed: Prefect's schema checks the fields inside a pydantic parameter
    (extra="forbid") but lets an unknown top-level parameter through to a run that would then fail
    on the worker; closed, the server refuses it when the run is created, naming it."""
    schema = d._parameter_openapi_schema  # what apply() registers; Prefect offers no public setter
    d._parameter_openapi_schema = _ClosedParameters(**schema.model_dump(exclude_unset=True), additionalProperties=False)
    return d


def declarations(s: DeploySettings, scheduled: Collection[str] = NIGHTLY) -> list[RunnerDeployment]:
    """Every deployment, as Prefect objects; nothing is registered yet. A nightly flow not in
    `scheduled` is declared with no schedule, which leaves the one the server has as it is."""
    common = {"work_pool_name": s.work_pool, "entrypoint_type": EntrypointType.MODULE_PATH, "tags": ["infersmith"]}
    pool = {"pool": s.pool.model_dump(mode="json")} if s.pool else {}

    def nightly(name: str) -> list[Cron] | None:
        return [Cron(s.cron, timezone=s.timezone, active=s.active, slug=SCHEDULE_SLUG)] if name in scheduled else None

    return [_closed(d) for d in (
        optimize_op.to_deployment(s.name(optimize_op.name), parameters=pool, description="Optimize one op for one "
                                  "target: every candidate a child run of the op's MLflow experiment. With the llm "
                                  "proposer, llm.api_key_secret names the Prefect Secret block holding the API key "
                                  "(never the key).", **common),
        optimize_engine.to_deployment(s.name(optimize_engine.name), parameters=pool, description="Search engine "
                                      "configurations end to end against the target's baseline; with engine_spec "
                                      "(vllm, sglang, infersmith or a spec file's path), that server's flags against "
                                      "its defaults.", **common),
        sweep.to_deployment(s.name(sweep.name), parameters={"plan": s.plan.model_dump(mode="json"), **pool},
                            schedules=nightly(sweep.name), description="Every op of the plan on every target of "
                            "it, each an optimize-op subflow.", **common),
        revalidate.to_deployment(s.name(revalidate.name), parameters=pool, schedules=nightly(revalidate.name),
                                 description="Today's winners run again on today's torch, triton, CUDA and driver; "
                                 "a regression fails the run, with an artifact naming it.", **common),
    )]


def ensure_work_pool(name: str) -> None:
    """A process work pool of that name, created with Prefect's default job template if missing."""
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return
        except ObjectNotFound:
            pass
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=ProcessWorker.type,
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:  # another deploy created it a moment ago
            pass


def _exists(full_name: str) -> bool:
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(full_name)
            return True
        except ObjectNotFound:
            return False


def register(s: DeploySettings, schedule: bool = True) -> list[str]:
    """Register every deployment on the server; their full names. `schedule` False keeps a nightly
    flow's schedule as the server has it (edited or paused in the UI), once its deployment exists."""
    ensure_work_pool(s.work_pool)
    deployments = declarations(s, [name for name in NIGHTLY if schedule or not _exists(f"{name}/{s.name(name)}")])
    for d in deployments:
        d.apply()
    return [d.full_name for d in deployments]


def sweep_name(s: DeploySettings) -> str:
    return f"{sweep.name}/{s.name(sweep.name)}"


def sweep_schedule(s: DeploySettings) -> str:
    """The sweep's schedule as the server has it now, in words."""
    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(sweep_name(s)).schedules
    return "; ".join(f"{d.schedule.cron} ({d.schedule.timezone}), {'active' if d.active else 'paused'}"
                     for d in found if hasattr(d.schedule, "cron")) or "none"
