"""A person's approval of a numerics change: the flow pauses with a form in the Prefect UI.

A candidate that passed every gate but is flagged `beyond_tolerance` (its error is over the
target's tolerance, within its approval tolerance) or `reduced_precision` (the screen found it
computing in a lower precision) counts only once a person approves it. The flow asks holding no
GPU lease: the stages are done, and it pauses only once nothing else is in flight, since Prefect
starts no task of a paused flow. No answer within the target's approval timeout rejects it; on
the ephemeral API no one can answer, so the candidate is rejected at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from prefect import get_client
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from prefect.settings import get_current_settings
from prefect.states import Running
from pydantic import Field

from contract.job import Candidate
from contract.verdict import BEYOND_TOLERANCE, Verdict
from flows import api_server
from targets import Target
from tasks.evaluate import Outcome
from tracking.schema import Tracker

APPROVED, REJECTED, TIMED_OUT, NO_SERVER = "approved", "rejected", "timed_out", "no_server"


class Approval(RunInput):
    """The form a person fills in to resume the flow."""

    decision: Literal["approve", "reject"] = Field("reject", description="approve: the candidate counts as passed")
    reviewer: str = Field(min_length=1, description="your name, logged with the decision")
    note: str = Field("", description="why, logged with the decision")


@dataclass(frozen=True)
class Decision:
    outcome: str  # approved, rejected, timed_out or no_server
    by: str
    at: str  # ISO 8601, UTC
    note: str

    @property
    def approved(self) -> bool:
        return self.outcome == APPROVED

    def detail(self) -> str:
        what = {APPROVED: "approved", REJECTED: "rejected", TIMED_OUT: "rejected: no decision in time",
                NO_SERVER: "rejected: no Prefect server to ask"}[self.outcome]
        return f"{what} by {self.by} at {self.at}" + (f": {self.note}" if self.note else "")


def reason(verdict: Verdict, target: Target) -> str:
    """Why the candidate waits, in one line."""
    why = []
    if BEYOND_TOLERANCE in verdict.flags:
        why.append(f"relative error {verdict.max_rel_error:.3g} is over the tolerance {target.tolerance:g} "
                   f"(within the approval tolerance {target.approval_rtol:g})")
    if "reduced_precision" in verdict.flags:
        screen = next((g.detail for g in verdict.gates if g.name == "screen"), "")
        found = [part.removeprefix("flag ") for part in screen.split("; ") if "reduced_precision" in part]
        why.append("the screen found it computing in a lower precision" + (f" ({found[0]})" if found else ""))
    return "; ".join(why)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def ask(candidate: Candidate, run_id: str, verdict: Verdict, target: Target) -> Decision:
    """Pause this flow run until a person approves or rejects the candidate, or the timeout."""
    why = reason(verdict, target)
    url = get_current_settings().api.url
    if url is None or api_server.is_own(url):  # Prefect's, or this command's own: no one can reach it
        note = ("the Prefect API is ephemeral, so no one can approve it: run against a Prefect server "
                "(`prefect server start`, then set PREFECT_API_URL) to approve")
        print(f"{candidate.label} needs a person's approval ({why}); rejected: {note}")
        return Decision(NO_SERVER, "infersmith", _now(), note)
    timeout = target.approval_timeout_s
    score = verdict.score()
    form = Approval.with_initial_data(description="\n".join([
        f"### {candidate.label} needs your approval", "",
        f"It passed every gate, but {why}.", "",
        f"- score: {score:.3g}x the best baseline" if score else "- score: not timed",
        f"- candidate id `{candidate.id}`, MLflow run `{run_id}`",
        f"- rejected unless decided within {timeout:g} s"]))
    print(f"{candidate.label} needs a person's approval ({why}): the flow pauses for up to {timeout:g} s; "
          "decide in the Prefect UI")
    try:
        got = pause_flow_run(wait_for_input=form, timeout=math.ceil(timeout), key=f"approve-{candidate.id}",
                             poll_interval=max(1, min(10, int(timeout / 20))))
    except FlowPauseTimeout:
        # The run is still Paused on the server, where an expired pause can only fail: set it
        # running again, so the flow goes on with the next candidate.
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Running(), force=True)
        return Decision(TIMED_OUT, "infersmith", _now(), f"no decision within {timeout:g} s")
    return Decision(APPROVED if got.decision == "approve" else REJECTED, got.reviewer, _now(), got.note)


def decide(outcome: Outcome, target: Target, tracker: Tracker) -> Outcome:
    """A held candidate's final verdict once a person decided, logged on its run."""
    decision = ask(outcome.candidate, outcome.run_id, outcome.verdict, target)
    verdict = outcome.verdict
    verdict.gate("approval", decision.approved, decision.detail())
    tracker.decide_candidate(outcome.run_id, verdict, decision.outcome, decision.by, decision.at, decision.note)
    return Outcome(outcome.candidate, verdict, outcome.charge, outcome.run_id, held_out=outcome.held_out)
