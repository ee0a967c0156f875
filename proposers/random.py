"""Uniform sampling over the template points not tried yet, the template's default first."""
from __future__ import annotations

import itertools
import random
from typing import Any, Sequence

from contract.job import Candidate
from proposers.base import Proposer, point_key
from tracking.trials import Trial

# Above this many points the product is not listed; points are drawn and redrawn instead.
ENUMERATE_LIMIT = 100_000


class RandomProposer(Proposer):
    name = "random"

    def propose(self, history: Sequence[Trial], n: int) -> list[Candidate]:
        points = self.unseen_points(self.seen(history), n, self.rng(history), default_first=not history)
        return [self.candidate(p) for p in points]

    def rng(self, history: Sequence[Trial]) -> random.Random:
        # A string seed is hashed with SHA-512, so it is the same in every process.
        return random.Random(f"{self.seed}/{len(history)}")

    def all_points(self):
        keys = list(self.template.space)
        for values in itertools.product(*self.template.space.values()):
            yield dict(zip(keys, values))

    def in_space(self, point: dict[str, Any]) -> bool:
        space = self.template.space
        return set(point) == set(space) and all(point[k] in space[k] for k in space)

    def default_point(self) -> dict[str, Any] | None:
        """The template's default when it is a point of the space: a known-good baseline."""
        default = self.template.default
        return dict(default) if default and self.in_space(default) else None

    def unseen_points(self, seen: set[str], n: int, rng: random.Random,
                      default_first: bool = False) -> list[dict[str, Any]]:
        """Up to n distinct points of the space whose keys are not in `seen`, drawn from `rng`."""
        taken = set(seen)
        picked: list[dict[str, Any]] = []
        default = self.default_point()
        if default_first and n > 0 and default is not None and point_key(default) not in taken:
            picked.append(default)
            taken.add(point_key(default))
        want = n - len(picked)
        if want <= 0:
            return picked
        if self.template.size() <= ENUMERATE_LIMIT:
            pool = [p for p in self.all_points() if point_key(p) not in taken]
            return picked + rng.sample(pool, min(want, len(pool)))
        # A space this large cannot be nearly exhausted by real trials, so redraws are rare;
        # the bound only keeps a pathological history from spinning forever.
        for _ in range(100 * want + 1000):
            if len(picked) == n:
                break
            p = {k: rng.choice(v) for k, v in self.template.space.items()}
            if point_key(p) not in taken:
                picked.append(p)
                taken.add(point_key(p))
        return picked
