"""Engine configurations to try: per op a kernel choice (from the op leaderboards) and the
engine's knobs, as one categorical space searched by an op proposer (`random` or `tpe`).

The same contract as an op proposer (proposers/base.py): `EngineProposer(...)` once per flow,
then `propose(history, n)` with every configuration tracking holds for this target, from any
flow, finished or pending; no state between calls. It returns at most n configurations, none
already in the history and no two alike; fewer when the space has nothing new left.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from contract.job import Candidate
from contract.serve import EngineCandidate
from engine_templates.ops.base import Template
from proposers.base import Proposer
from proposers.random import RandomProposer
from proposers.tpe import TPEProposer
from tracking.trials import PENDING, EngineTrial, Trial

KNOBS = {
    "block_size": [16, 32],
    "max_num_seqs": [16, 32, 64, 128],
    "max_num_batched_tokens": [512, 1024, 2048, 4096],
    "cuda_graph_max_batch": [0, 8, 32, 64],
    # speculative decoding by prompt lookup: draft tokens per step (0: off) and the longest n-gram;
    # with no drafts the n-gram size is moot (EngineCandidate keeps one value for it)
    "spec_tokens": [0, 3, 7],  # 4 and 8 rows a sequence in a verify step
    "spec_ngram": [2, 3, 4],
}
EAGER = "eager"


class EngineTPE(TPEProposer):
    def startup_trials(self) -> int:
        # A configuration costs minutes of serving and the default budget is 8: TPE models the
        # history from the fifth trial on rather than drawing nearly all of it at random.
        return 4


SEARCHES: dict[str, type[Proposer]] = {"random": RandomProposer, "tpe": EngineTPE}


def choice_key(choice: dict) -> str:
    """A kernel choice by what it runs, the same in every flow. A free kernel goes by its file's
    name: kernel_choices names it after its leaderboard candidate's content hash, while the
    folder is each flow's scratch."""
    if choice.get("impl") == EAGER:
        return EAGER
    if choice.get("impl") == "template":
        return f"{choice['template']}{json.dumps(choice['point'], sort_keys=True)}"
    if choice.get("impl") == "free":
        return f"free:{Path(choice['path']).name}"
    return json.dumps(choice, sort_keys=True)


class EngineSpace:
    """Dimensions `kernel.<op>` (each op with a choice besides eager; values: choice keys) and
    `engine.<knob>`. The op proposers search a Template's space, so the space is given to them
    as one; it is never built."""

    def __init__(self, kernel_options: dict[str, list[dict]], on_gpu: bool, knobs: dict[str, list] = KNOBS):
        self.knobs = knobs
        self.choices = {f"kernel.{op}": {choice_key(c): c for c in options}
                        for op, options in sorted(kernel_options.items()) if len(options) > 1}
        knobs = knobs | ({} if on_gpu else {"cuda_graph_max_batch": [0]})  # no CUDA graphs without a GPU
        space: dict[str, list[Any]] = {k: list(v) for k, v in self.choices.items()}
        space |= {f"engine.{k}": list(v) for k, v in knobs.items()}
        # The default point, proposed first into an empty history: every op eager, the engine's
        # own knob values where offered.
        engine = EngineCandidate()
        default = {k: v[0] for k, v in space.items()}
        default |= {k: EAGER for k, v in self.choices.items() if EAGER in v}
        default |= {f"engine.{k}": getattr(engine, k) for k, v in knobs.items() if getattr(engine, k) in v}
        self.template = Template(name="engine", module=__name__, space=space, default=default)

    def point(self, cand: EngineCandidate) -> dict[str, Any]:
        """Its point. A kernel or knob value not offered now (an older leaderboard, an included
        kernels file) leaves it outside the space, where it only counts as tried."""
        kernels = {f"kernel.{op}": choice_key(c) for op, c in cand.kernels.items() if choice_key(c) != EAGER}
        return ({k: EAGER for k in self.choices} | kernels
                | {f"engine.{k}": getattr(cand, k) for k in self.knobs})

    def candidate(self, point: dict[str, Any], origin: str) -> EngineCandidate:
        kernels = {k.removeprefix("kernel."): self.choices[k][v] for k, v in point.items()
                   if k.startswith("kernel.") and v != EAGER}
        knobs = {k.removeprefix("engine."): v for k, v in point.items() if k.startswith("engine.")}
        return EngineCandidate(kernels=kernels, origin=origin, **knobs)


class EngineProposer:
    def __init__(self, name: str, kernel_options: dict[str, list[dict]], on_gpu: bool, seed: int = 0,
                 knobs: dict[str, list] = KNOBS):
        """`knobs`: the engine settings searched and their values (EngineCandidate fields); the
        rest keep the engine's defaults."""
        if name not in SEARCHES:
            raise KeyError(f"unknown proposer {name!r}; known: {', '.join(sorted(SEARCHES))}")
        self.name = name
        self.space = EngineSpace(kernel_options, on_gpu, knobs)
        self.search = SEARCHES[name]("engine", self.space.template, seed)

    def propose(self, history: Sequence[EngineTrial], n: int) -> list[EngineCandidate]:
        """Up to n new configurations given every configuration tried so far."""
        tried = {t.id for t in history}
        trials = self.trials(history)
        out: list[EngineCandidate] = []
        while len(out) < n:
            got = self.search.propose(trials, n - len(out))
            if not got:
                break
            for c in got:
                cand = self.space.candidate(c.point, self.name)
                # A new point can still be a tried configuration spelt another way (an included
                # kernels file naming a leaderboard kernel by its own path, an n-gram size without
                # drafts): then it joins the history as pending and the search is asked again.
                if cand.id not in tried:
                    out.append(cand)
                    tried.add(cand.id)
                trials.append(Trial(c, PENDING))
        return out

    def trials(self, history: Sequence[EngineTrial]) -> list[Trial]:
        """The history as the op proposers read it. Crashes and failures go to TPE's floor,
        below every score. A near miss counts with its score, capped at the lowest passing
        score: it was accurate and served every pattern, so its geometric mean tells TPE how
        close its knobs came (as the floor it would look like a crash, and TPE would learn
        nothing while nothing passes yet, as on a CPU pool); but the flow wants a configuration
        that passes, so one that trades a short metric for others never ranks above one that
        does not."""
        passed = [t.score for t in history if t.state == "pass" and t.score is not None]
        out = []
        for t in history:
            state, score = t.state, t.score
            if state == "fail" and score is not None:
                state, score = "pass", min([score, *passed])
            point = self.space.point(t.candidate)
            out.append(Trial(Candidate("engine", "template", "engine", point, origin=t.candidate.origin), state, score))
        return out
