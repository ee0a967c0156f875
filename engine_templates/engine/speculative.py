"""Speculative decoding without a draft model: prompt lookup (n-gram) drafts, verified in the
decode step.

Drafting (the scheduler, for a pure decode step): a greedy sequence's last n tokens (n =
EngineConfig.spec_ngram, then shorter down to 1) are looked up in its own earlier tokens, prompt
and completion; the up to EngineConfig.spec_tokens tokens that followed their latest earlier
occurrence are its draft. Text that repeats itself — records, code, quoted documents, a model
that loops — drafts well; ordinary prose rarely finds a match, and then the step is a plain decode.

Verification (the model runner): a sequence with d drafts takes 1 + d rows of the decode step —
its last token and the drafts, at their positions, each row attending to the cache up to its own
position (every row's K/V is written before attention, so row j sees the drafts before it: a
causal verify). It is an ordinary decode batch of more rows, so the decode kernels and the CUDA
graphs serve it unchanged (cuda_graphs.py captures sizes up to max_num_seqs * (1 + spec_tokens)).

Acceptance (`accept`): the greedy token of each row; drafts are accepted while each equals the
token the row before chose, and the first disagreement's own choice (or, all accepted, the last
row's) comes free: 1 + accepted tokens per step, each exactly the token plain greedy decoding
gives (the same argmax over the same context), with its log-probability. The K/V written for
rejected drafts lie past the sequence's length: never attended to, overwritten by the next step.

Sampled (temperature > 0) requests are not drafted: one token per step, as without speculation.

Back-off (`Backoff`): a step that drafts cannot be queued ahead of the one before (async decode,
engine.py), since its drafts depend on the tokens that step accepts; with nothing accepted, drafting
would cost that overlap and the verify rows for nothing. So a sequence whose last MISS_STREAK
chances to draft gave no accepted token (no n-gram found, or every draft rejected) stops drafting
for a pause of steps, doubled at each new streak up to LONGEST_PAUSE and back to FIRST_PAUSE as
soon as a draft is accepted. While every sequence of a decode batch is paused, the steps are
queued ahead as without speculation. Drafts never change a token, so neither does the back-off.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine_templates.engine.sequence import Sequence


class NgramIndex:
    """Per sequence: for each n-gram (n <= longest) the position just after its latest occurrence
    that is followed by at least one token; extended as tokens are appended, never rebuilt."""

    def __init__(self, longest: int):
        self.longest = longest
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(longest + 1)]
        self.indexed = 0  # n-grams ending before this position are in the index

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the last n tokens,
        for the longest n that has one."""
        end = len(tokens) - 1  # n-grams ending at the last token are the query, not the index
        for e in range(max(self.indexed, 1), end + 1):
            for n in range(1, min(self.longest, e) + 1):
                self.after[n][tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end + 1)
        for n in range(min(self.longest, len(tokens)), 0, -1):
            start = self.after[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + limit]
        return []


MISS_STREAK = 3  # chances to draft without an accepted token before drafting pauses
FIRST_PAUSE, LONGEST_PAUSE = 4, 64  # steps without drafting: the first pause, and the cap as it doubles


@dataclass
class Backoff:
    """One sequence's drafting pauses (module docstring)."""

    misses: int = 0  # chances in a row without an accepted token
    pause: int = 0  # steps left without drafting
    next_pause: int = FIRST_PAUSE

    def miss(self) -> None:
        self.misses += 1
        if self.misses >= MISS_STREAK:
            self.misses, self.pause = 0, self.next_pause
            self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)

    def hit(self) -> None:
        self.misses, self.next_pause = 0, FIRST_PAUSE


class PromptLookup:
    """The drafter: `spec_tokens` tokens at most per step, n-grams of `ngram` tokens at most."""

    def __init__(self, spec_tokens: int, ngram: int):
        self.spec_tokens, self.ngram = spec_tokens, ngram

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """The sequence's draft for the step being scheduled, at most `limit` tokens (what its
        length and max_tokens leave); [] while its drafting is paused."""
        limit = min(limit, self.spec_tokens)
        if limit <= 0 or not seq.params.greedy:
            return []
        if seq.ngram_index is None:
            seq.ngram_index, seq.spec_backoff = NgramIndex(self.ngram), Backoff()
        if seq.spec_backoff.pause:
            seq.spec_backoff.pause -= 1
            return []
        draft = seq.ngram_index.lookup(seq.token_ids, limit)
        if not draft:
            seq.spec_backoff.miss()
        return draft

    def idle(self, seq: Sequence) -> bool:
        """Whether the sequence's next step surely has no draft, so that step can be queued
        before this one's tokens are known."""
        return not seq.params.greedy or (seq.spec_backoff is not None and seq.spec_backoff.pause > 0)

    def skip(self, seq: Sequence) -> None:
        """A step scheduled ahead for an idle sequence: one step of its pause spent."""
        if seq.spec_backoff is not None:
            seq.spec_backoff.pause = max(0, seq.spec_backoff.pause - 1)

    def verified(self, seq: Sequence, accepted: int) -> None:
        """A step verified the sequence's draft and accepted `accepted` of its tokens."""
        if accepted:
            seq.spec_backoff.hit()
        else:
            seq.spec_backoff.miss()


def accept(draft: list[int], rows: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The tokens (with log-probabilities) a verify step yields: `rows` holds each row's greedy
    choice, the first row's after the sequence's last token and row j's after draft j - 1."""
    n = 0
    while n < len(draft) and draft[n] == rows[n][0]:
        n += 1
    return rows[:n + 1]


@dataclass
class SpecStats:
    """What speculation did since the engine started: sequence-steps that verified a draft, draft
    tokens and how many were accepted."""

    verify_rows: int = 0  # sequence-steps with a draft
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.verify_rows += 1
            self.drafted += drafted
            self.accepted += accepted

    def as_dict(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else None
        return {"verify_steps": self.verify_rows, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted, "acceptance_rate": rate}
