"""Optuna's TPE over the template's categorical space, rebuilt from the history on every call; the
warm start's points (published knowledge from other targets) are its first trials."""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.samplers import TPESampler
from optuna.trial import TrialState, create_trial

from contract.job import Candidate
from proposers.base import KNOWLEDGE, Proposer, point_key
from proposers.random import RandomProposer
from tracking.trials import PENDING, Trial

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Asks per wanted candidate before the rest are drawn uniformly: on a mostly tried space
# TPE keeps landing on tried points.
ASKS_PER_CANDIDATE = 10


class TPEProposer(Proposer):
    name = "tpe"

    def propose(self, history: Sequence[Trial], n: int) -> list[Candidate]:
        uniform = RandomProposer(self.op, self.template, self.seed)
        # The space may have changed since a trial ran: its point then tells TPE nothing.
        known = sorted((t for t in history if t.candidate.kind == "template"
                        and t.candidate.template == self.template.name
                        and uniform.in_space(t.candidate.point)), key=_order)
        n = min(n, self.template.size() - len({point_key(t.candidate.point) for t in known}))
        if n <= 0:
            return []
        taken = self.seen(history)
        picked: list[dict[str, Any]] = []
        # The warm start's points not tried yet, then (into an empty history) the template's
        # default, are the study's first trials: optuna hands enqueued trials out before it samples.
        first = [p for p in self.warm_start if uniform.in_space(p)]
        if not history and (default := uniform.default_point()) is not None:
            first.append(default)
        queued = {point_key(p): p for p in first if point_key(p) not in taken}

        distributions = {k: CategoricalDistribution(v) for k, v in self.template.space.items()}
        study = self.study(known, distributions, len(history))
        for point in queued.values():
            study.enqueue_trial(point)
        for _ in range(ASKS_PER_CANDIDATE * n):
            if len(picked) == n:
                break
            # A rejected ask stays RUNNING in the study, so the constant liar steers later
            # asks away from that tried point too.
            params = study.ask(distributions).params
            point = {k: params[k] for k in self.template.space}
            if point_key(point) not in taken:
                picked.append(point)
                taken.add(point_key(point))
        picked += uniform.unseen_points(taken, n - len(picked), uniform.rng(history))
        warm = {point_key(p) for p in self.warm_start}
        return [self.candidate(p, KNOWLEDGE if point_key(p) in warm else None) for p in picked]

    def startup_trials(self) -> int:
        """Trials TPE draws at random before it models the history."""
        return min(8, max(2, self.template.size() // 10))

    def study(self, known: list[Trial], distributions: dict[str, CategoricalDistribution],
              n_history: int) -> optuna.Study:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            sampler = TPESampler(seed=(self.seed * 1_000_003 + n_history) % 2**32, multivariate=True,
                                 constant_liar=True, n_startup_trials=self.startup_trials())
        study = optuna.create_study(direction="maximize", sampler=sampler)
        # Failures go in as COMPLETE with a value below every real score, not as FAIL: TPE
        # ignores FAIL trials entirely, so it would keep sampling where kernels break, and
        # they would not count toward its random start-up trials either.
        scores = [t.score for t in known if t.state == "pass" and t.score is not None]
        floor = min(scores, default=0.0) - 1.0
        for t in known:
            if t.state == PENDING:
                state, value = TrialState.RUNNING, None
            elif t.state == "pass":
                if t.score is None:
                    continue  # passed but not timed: nothing to rank it by
                state, value = TrialState.COMPLETE, t.score
            else:
                state, value = TrialState.COMPLETE, floor
            study.add_trial(create_trial(state=state, value=value, params=t.candidate.point,
                                         distributions=distributions))
        return study


def _order(t: Trial) -> tuple:
    # TPE weighs trials by their order; sorting makes the proposals depend on which trials
    # there are, not on the order tracking happened to return them in.
    return (point_key(t.candidate.point), t.state, -1e300 if t.score is None else t.score)
