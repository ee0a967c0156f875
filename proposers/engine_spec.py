"""Configurations of an engine spec file (targets/engine_spec.py), searched by Optuna's TPE over
the file's own space: integers and floats with their ranges and steps, choices, booleans, and a
knob asked only where it applies (Optuna's define-by-run), so TPE models each knob as what it is.

The contract of every engine proposer (proposers/engine.py): `SpecProposer(spec, seed)` once per
flow, then `propose(history, n)` with every configuration tracking holds for this target, from any
flow; no state between calls. It returns at most n configurations, none already tried, none the
baseline's (the file's defaults, measured as the baseline), no two alike; fewer when the space has
nothing new left.
"""
from __future__ import annotations

import random
import warnings
from typing import Any, Sequence

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.samplers import TPESampler
from optuna.trial import TrialState, create_trial

from contract.serve import EngineCandidate
from targets.engine_spec import EngineSpec, Knob
from tracking.trials import PENDING, EngineTrial

optuna.logging.set_verbosity(optuna.logging.WARNING)
ASKS_PER_CANDIDATE = 10  # TPE's asks per wanted configuration before one is drawn uniformly
ENUMERATE = 100_000  # a space this small is listed whole, so that its last points are found
STARTUP = 4  # random trials before TPE models the history: a configuration costs minutes


def distribution(knob: Knob) -> BaseDistribution:
    if knob.type == "int":
        return IntDistribution(int(knob.low), int(knob.high), step=int(knob.step or 1))
    if knob.type == "float":
        return FloatDistribution(knob.low, knob.high, step=knob.step)
    return CategoricalDistribution(knob.values())


class SpecProposer:
    def __init__(self, spec: EngineSpec, name: str = "tpe", seed: int = 0):
        """`name`: "tpe", or "random" (every configuration drawn uniformly: the baseline of searches)."""
        if name not in ("tpe", "random"):
            raise KeyError(f"unknown proposer {name!r}; known: random, tpe")
        self.spec, self.name, self.seed = spec, name, seed
        self.distributions = {name: distribution(k) for name, k in spec.knobs.items()}
        self.baseline = spec.candidate(spec.defaults(), "baseline")

    def propose(self, history: Sequence[EngineTrial], n: int) -> list[EngineCandidate]:
        """Up to n new configurations given every configuration tried so far."""
        tried = {t.id for t in history} | {self.baseline.id}
        rng = random.Random(self.seed * 7919 + len(history))
        if self.name == "random":
            return self.uniform(tried, n, rng)
        known = sorted((t for t in history if t.candidate.engine == self.spec.engine
                        and self.spec.holds(t.candidate.settings)), key=lambda t: t.id)
        study = self.study(known, len(history))
        out: list[EngineCandidate] = []
        for _ in range(ASKS_PER_CANDIDATE * n):
            if len(out) == n:
                break
            trial = study.ask()  # a rejected ask stays RUNNING: the constant liar steers away from it
            cand = self.spec.candidate(self.spec.settle(lambda name, knob: self.suggest(trial, name, knob)), "tpe")
            if cand.id not in tried:
                out.append(cand)
                tried.add(cand.id)
        return out + self.uniform(tried, n - len(out), rng)

    def suggest(self, trial: optuna.Trial, name: str, knob: Knob) -> Any:
        d = self.distributions[name]
        if isinstance(d, IntDistribution):
            return trial.suggest_int(name, d.low, d.high, step=d.step)
        if isinstance(d, FloatDistribution):
            return trial.suggest_float(name, d.low, d.high, step=d.step)
        return trial.suggest_categorical(name, d.choices)

    def uniform(self, tried: set[str], n: int, rng: random.Random) -> list[EngineCandidate]:
        """n untried configurations drawn uniformly: from the whole list when the space is small
        enough to list (so that none is missed), else by drawing."""
        if n <= 0:
            return []
        every = self.spec.every(ENUMERATE)
        if every is not None:
            fresh = [c for c in (self.spec.candidate(s, "random") for s in every) if c.id not in tried]
            return rng.sample(fresh, min(n, len(fresh)))
        out: list[EngineCandidate] = []
        for _ in range(100 * n):
            if len(out) == n:
                break
            cand = self.spec.candidate(self.spec.settle(lambda name, knob: _draw(knob, rng)), "random")
            if cand.id not in tried:
                out.append(cand)
                tried.add(cand.id)
        return out

    def study(self, known: list[EngineTrial], n_history: int) -> optuna.Study:
        """The history as TPE's trials. Crashes and failures go to a floor below every score; a
        near miss (accurate, served every pattern, short of the baseline on some metric) counts
        with its score capped at the lowest passing one, as in the engine's own search."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            sampler = TPESampler(seed=(self.seed * 1_000_003 + n_history) % 2**32, multivariate=True, group=True,
                                 constant_liar=True, n_startup_trials=STARTUP)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        passed = [t.score for t in known if t.state == "pass" and t.score is not None]
        floor = min(passed, default=0.0) - 1.0
        for t in known:
            settings = t.candidate.settings
            if t.state == PENDING:
                state, value = TrialState.RUNNING, None
            elif t.state == "pass" and t.score is not None:
                state, value = TrialState.COMPLETE, t.score
            elif t.state == "fail" and t.score is not None:
                state, value = TrialState.COMPLETE, min([t.score, *passed])
            else:
                state, value = TrialState.COMPLETE, floor
            study.add_trial(create_trial(state=state, value=value, params=settings,
                                         distributions={k: self.distributions[k] for k in settings}))
        return study


def _draw(knob: Knob, rng: random.Random) -> Any:
    if knob.type == "float" and not knob.step:
        return rng.uniform(knob.low, knob.high)
    return rng.choice(knob.values())
