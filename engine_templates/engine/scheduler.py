"""Which sequences run next: decodes and prompt chunks, batched to a token budget.

A sequence is decoding when exactly one of its tokens is left to compute (the last one
sampled, or the last token of a prompt); a prompt with more left is prefilling, in chunks.
With mixed steps (EngineConfig.mixed_steps, the default) a step takes every decoding
sequence's one token first, then prompt chunks (prompts already admitted and mid-way, then
waiting ones admitted in order) with what is left of max_num_batched_tokens; such a step runs
through the prefill path, a decode token being a one-token chunk whose prefix is its whole
cache. A step with no prompt chunk is a pure decode step (CUDA graphs on a GPU); one with no
decode is a pure prefill step. Without mixed steps a step is either prefill (prompt chunks up
to the budget) or decode: while any prompt has tokens left, decodes wait.

When the cache runs out of blocks for a decode, the most recently admitted sequence (decoding
or mid-prompt) is preempted by recomputation: its blocks are freed and it goes back to the
front of the queue with every token it has, to be prefilled again. A step that preempted
admits no waiting prompt, so a victim is never back in the step that evicted it. A decoding
sequence that alone needs more blocks than the cache has is not preempted (it would come back to
the same point forever): it finishes with "length", reported by the engine's next step.

`schedule_ahead` serves async decode (engine.py): the decode step after one still in flight,
before its tokens are known, when it is the step `schedule` would give once they are in.

With speculative decoding (EngineConfig.spec_tokens) a pure decode step gives each greedy
sequence its prompt-lookup draft (speculative.py) where the cache has the blocks for it; a
sequence without them, or in a step with prompt chunks, decodes one token.
"""
from __future__ import annotations

from collections import deque

from engine_templates.engine.block_manager import BlockManager
from engine_templates.engine.config import EngineConfig
from engine_templates.engine.sequence import Sequence, Status
from engine_templates.engine.speculative import PromptLookup


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.mixed_steps = config.mixed_steps
        self.max_model_len = config.max_model_len
        self.drafter = PromptLookup(config.spec_tokens, config.spec_ngram) if config.spec_tokens else None
        self.mixed_steps_run = 0  # steps that had both decodes and prompt chunks
        self.preemptions = 0
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Finished by the scheduler itself (a sequence that has filled the whole cache), for
        # the engine to report with its step's sequences: take_ended()
        self._ended: list[Sequence] = []

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

    def take_ended(self) -> list[Sequence]:
        ended, self._ended = self._ended, []
        return ended

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences with num_scheduled_tokens set, is_prefill); empty when there is no work.
        is_prefill: the step runs through the prefill path (prompt chunks, with or without
        decodes); a mixed step lists its decodes first."""
        if not self.mixed_steps:
            batch = self._schedule_prefill(self.max_num_batched_tokens, admit=True)
            if batch:
                return batch, True
            decodes, _ = self._schedule_decode()
            return self._add_drafts(decodes), False
        decodes, preempted = self._schedule_decode()
        budget = self.max_num_batched_tokens - len(decodes)
        chunks = self._schedule_prefill(budget, admit=not preempted) if budget > 0 else []
        if not chunks:
            return self._add_drafts(decodes), False
        if decodes:
            self.mixed_steps_run += 1
        return decodes + chunks, True

    def schedule_ahead(self, in_flight: list[Sequence], finishing) -> list[Sequence]:
        """The pure decode step after the decode step `in_flight`, whose tokens are not appended
        yet: every running sequence but those `finishing(seq)` says end with that token, in
        order, each allocated a cache slot one position past its last token. [] (and nothing
        allocated) where `schedule` might give another step once the tokens are in: a running
        sequence not in flight (a prompt mid-way), a waiting prompt with a free place and the
        blocks to be admitted, or too few free blocks (a preemption). A sequence that ends with
        the token in flight unforeseen (EOS, a stop string) still has its row in the step ahead;
        the engine discards it."""
        flying = {s.seq_id for s in in_flight}
        if any(s.seq_id not in flying for s in self.running):
            return []
        batch = [s for s in self.running if not finishing(s)]
        bm = self.block_manager
        need = sum(bm.blocks_for(s.num_tokens + 1) - len(s.block_table) for s in batch)
        if need > bm.num_free:
            return []
        if self.waiting and len(batch) < self.max_num_seqs:
            # `schedule` would admit the first waiting prompt only if its blocks are free after
            # the decodes' (those ending with the token in flight give theirs back): if not, its
            # step is this same pure decode step, and it can go ahead.
            head = self.waiting[0]
            freed = sum(len(s.block_table) for s in self.running if finishing(s))
            taken = need if self.mixed_steps else 0  # without mixed steps a prompt goes before decodes
            if bm.blocks_for(head.num_tokens) - len(head.block_table) <= bm.num_free + freed - taken:
                return []
        for seq in batch:
            bm.allocate(seq, seq.num_tokens + 1)
            seq.num_scheduled_tokens = 1
            if self.drafter is not None:
                self.drafter.skip(seq)
        return batch

    def _add_drafts(self, decodes: list[Sequence]) -> list[Sequence]:
        """Each decoding sequence's draft (speculative.py), as long as its length, max_tokens and
        the free blocks allow; it then has 1 + len(draft) tokens scheduled."""
        if self.drafter is None:
            return decodes
        bm = self.block_manager
        for seq in decodes:
            # A step yields at most 1 + len(draft) tokens: no more than max_tokens or the model allow.
            room = min(seq.params.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
            draft = self.drafter.draft(seq, room)
            while draft and not bm.can_allocate(seq, seq.num_tokens + len(draft)):
                draft = draft[:-1]
            bm.allocate(seq, seq.num_tokens + len(draft))
            seq.draft = draft
            seq.num_scheduled_tokens = 1 + len(draft)
        return decodes

    def _schedule_prefill(self, budget: int, admit: bool) -> list[Sequence]:
        """Prompt chunks up to `budget` tokens: admitted prompts mid-way first, then (if
        `admit`) waiting ones, each allocated its whole prompt up front."""
        batch = []
        for seq in self.running:  # prompts already admitted, in the middle of a chunked prefill
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1 and budget > 0:
                seq.num_scheduled_tokens = min(left, budget)
                budget -= seq.num_scheduled_tokens
                batch.append(seq)
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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

    def _schedule_decode(self) -> tuple[list[Sequence], bool]:
        """Every decoding sequence (one token left to compute) with a cache slot for it, and
        whether making room preempted any sequence. A victim is always the last of `running`,
        never one already taken into the batch."""
        batch, preempted = [], False
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below while making room for an earlier one
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue  # mid-way through a chunked prompt: not decoding
            if self.block_manager.blocks_for(seq.num_tokens) > self.block_manager.num_blocks:
                # Even alone it cannot have a slot for its next token: preempting it would
                # bring it back to the same point forever. It ends where the cache does.
                self.finish(seq, "length")
                self._ended.append(seq)
                continue
            while not self.block_manager.can_allocate(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.block_manager.allocate(seq, seq.num_tokens)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        return batch, preempted

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
