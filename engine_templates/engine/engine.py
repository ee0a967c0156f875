"""LLMEngine: requests in, tokens out. step() = schedule -> run -> postprocess."""
from __future__ import annotations

import logging

import torch

from engine_templates.engine.block_manager import BlockManager
from engine_templates.engine.config import EngineConfig, ModelConfig
from engine_templates.engine.kernels import KernelSet
from engine_templates.engine.model_runner import ModelRunner
from engine_templates.engine.scheduler import Scheduler
from engine_templates.engine.sequence import SamplingParams, Sequence, Status
from engine_templates.engine.tokenizer import Tokenizer

log = logging.getLogger("infersmith.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, model_config: ModelConfig | None = None,
                 weights: dict[str, torch.Tensor] | None = None):
        """From config.model_dir (config.json, safetensors, tokenizer.json); or, with no model
        directory, from `model_config` and `weights` on the device (e.g. loader.random_weights),
        used as they are, not copied, and without a tokenizer: prompts are token ids."""
        self.config = config
        if config.model_dir is None:
            assert model_config is not None and weights is not None, \
                "without a model directory, give the model config and its weights"
            self.model_config, self.tokenizer = model_config, None
        else:
            self.model_config = ModelConfig.from_dir(config.model_dir)
            self.tokenizer = Tokenizer(config.model_dir)
        self.kernels = KernelSet(config.kernels)
        self.runner = ModelRunner(config, self.model_config, self.kernels, weights)
        self.scheduler = Scheduler(config, BlockManager(self.runner.num_blocks, config.block_size))
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.largest_batch = 0  # the most sequences one step has run: evidence of batching
        log.info("engine kernels: %s", self.kernels.choices)

    @property
    def kernel_choices(self) -> dict:
        return self.kernels.choices

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """A new sequence in the queue. ValueError (a message for the client) if it cannot fit."""
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise ValueError("an engine without a tokenizer takes token ids, and no stop strings")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= t < self.model_config.vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab})")
        limit = self.config.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds the model length of {limit} tokens")
        seq = Sequence(ids, params, device=self.config.device)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """One model step; returns the sequences that got a token (finished ones included)."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        self.largest_batch = max(self.largest_batch, len(seqs))
        results = self.runner.run(seqs, is_prefill)
        return self.postprocess(seqs, results)

    def postprocess(self, seqs: list[Sequence], results) -> list[Sequence]:
        updated = []
        for seq, result in zip(seqs, results):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            if result is None:
                continue
            token, logprob = result
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
            updated.append(seq)
        return updated

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        stopped_on_token = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
        # The text before `searched` is the same as at the previous token, when no stop string
        # was in it (or the sequence would have finished): a stop string found now ends after it.
        searched = len(seq.decoded.text)
        if self.tokenizer is not None:
            end = seq.num_tokens - 1 if stopped_on_token else seq.num_tokens
            seq.text = self.tokenizer.decode_more(seq.token_ids, seq.num_prompt_tokens, end, seq.decoded)
        if p.stop:
            hits = [(i, s) for s in p.stop if (i := seq.text.find(s, max(0, searched - len(s) + 1))) >= 0]
            if hits:
                seq.text = seq.text[:min(hits)[0]]
                return "stop"
        if stopped_on_token:
            return "stop"
        if seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def generate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[Sequence]:
        """Every prompt to completion, batched; the finished sequences in prompt order."""
        seqs = [self.add_request(p, params) for p in prompts]
        while any(not s.is_finished for s in seqs):
            self.step()
        return seqs


def stream_safe_text(seq: Sequence) -> str:
    """The part of the text that later tokens cannot change: an incomplete UTF-8 character at
    the end may still complete, and the last characters may be the start of a stop string."""
    if seq.status is Status.FINISHED:
        return seq.text
    text = seq.text.rstrip("\ufffd")
    hold = max((len(s) for s in seq.params.stop), default=1) - 1
    return text[:len(text) - hold] if hold else text
