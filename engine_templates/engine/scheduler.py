"""Which sequences run next: prefill first, chunked to a token budget, then batched decode.

A step is either prefill (prompt tokens of one or more sequences, at most
max_num_batched_tokens in all; a longer prompt continues in the next steps) or decode (one
token for every running sequence). There are no mixed steps: while any prompt has tokens left,
decodes wait. When the cache runs out of blocks during decode, the most recently admitted
sequence is preempted by recomputation: its blocks are freed and it goes back to the front of
the queue with every token it has, to be prefilled again.
"""
from __future__ import annotations

from collections import deque

from engine_templates.engine.block_manager import BlockManager
from engine_templates.engine.config import EngineConfig
from engine_templates.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if self.block_manager.blocks_for(seq.num_tokens) > self.block_manager.num_blocks:
            raise ValueError(f"the prompt needs more KV-cache blocks than the engine has "
                             f"({self.block_manager.num_blocks})")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences with num_scheduled_tokens set, is_prefill); empty when there is no work."""
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        batch = []
        for seq in self.running:  # prompts already admitted, in the middle of a chunked prefill
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1 and budget > 0:
                seq.num_scheduled_tokens = min(left, budget)
                budget -= seq.num_scheduled_tokens
                batch.append(seq)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq, seq.num_tokens):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_tokens)  # the whole prompt, up front
            seq.status = Status.RUNNING
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below while making room for an earlier one
            while not self.block_manager.can_allocate(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.block_manager.allocate(seq, seq.num_tokens)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
