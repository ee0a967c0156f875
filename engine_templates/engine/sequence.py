"""The one object the scheduler, the model runner and the engine pass between them."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

import torch

from engine_templates.engine.tokenizer import DecodedPrefix


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # ValueError, not assert: these come from requests, and the server answers 400 with them.
        if not self.temperature >= 0:
            raise ValueError("temperature must be at least 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be at least 0 (0: no limit)")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, device: str = "cpu"):
        if not prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        self.seq_id = next(Sequence._ids)
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # positions whose K/V are in the cache
        self.num_scheduled_tokens = 0  # set by the scheduler for the coming step
        self.draft: list[int] = []  # speculative tokens the coming step verifies (speculative.py)
        self.ngram_index = None  # the drafter's index of this sequence's tokens, built as it grows
        self.spec_backoff = None  # the drafter's pauses after chances to draft that gained nothing
        self.block_table: list[int] = []
        self.status = Status.WAITING
        self.logprobs: list[float] = []  # of each completion token under the model
        self.text = ""  # the completion, detokenized, cut at a stop string
        self.decoded = DecodedPrefix()  # completion tokens whose text is final (Tokenizer.decode_more)
        self.finish_reason: str | None = None
        self.generator = (torch.Generator(device=device).manual_seed(params.seed)
                          if params.seed is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def samples_after_step(self) -> bool:
        """Whether the scheduled tokens reach the end, so the step produces a new token (a draft's
        tokens are scheduled beyond it: speculative.py)."""
        return self.num_computed_tokens + self.num_scheduled_tokens - len(self.draft) == self.num_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
