"""LLMEngine: requests in, tokens out. step() = schedule -> run -> postprocess.

Async decode (EngineConfig.async_decode, on by default): the host's part of a decode step
(scheduling, building inputs, launching, reading the tokens back, postprocess) runs while the
device computes the previous step, instead of the device idling while it runs. In steady decoding,
step() queues the decode step N+1 behind step N before reading N's tokens, then reads them and
postprocesses while N+1 computes; it returns N's sequences, so each token is delivered as soon
as it is known, and the next call does the same with N+1 in flight. N+1 is fully known on the
host without N's tokens: its sequences are N's (Scheduler.schedule_ahead), each one token
longer, so positions, cache slots and block tables are built ahead and its blocks allocated
before N's result; only its input ids are N's tokens, gathered per row on the device into the
graph's static input buffer (ModelRunner.prepare_decode). A sequence known to end with N's
token (max_tokens, the model length) is left out of N+1; one that ends unforeseen (EOS, a stop
token or string) or is aborted meanwhile keeps its row in N+1, and that row is discarded: its
token never appended, its blocks freed at once (the device runs steps in order, so a later step
that reuses them runs after N+1). Tokens and log-probabilities per sequence are the same as
synchronously, for greedy and seeded sampling; unseeded sampling draws from the engine's one
generator per row, so a discarded row shifts the later draws.

It is used only for pure decode steps on the CUDA graph path (DecodeGraphs, run without capture
on a CPU in the tests); with speculative decoding, only while no sequence of the batch may draft in
the step ahead (its drafting paused: speculative.py). Every other step is the plain synchronous one, scheduled after the
previous step's tokens are in: a prefill or mixed step, an eager decode, and whenever the next
step might differ from `schedule`'s (a prompt waiting with a free place in the batch, a prompt
mid-way, a preemption: Scheduler.schedule_ahead). Sampling needs nothing from the host that is
not known ahead (the per-request settings, the chosen token's log-probability computed always).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from engine_templates.engine.block_manager import BlockManager
from engine_templates.engine.config import EngineConfig, ModelConfig
from engine_templates.engine.fp8 import Fp8Scheme
from engine_templates.engine.kernels import KernelSet
from engine_templates.engine.model_runner import LaunchedStep, ModelRunner
from engine_templates.engine.scheduler import Scheduler
from engine_templates.engine.sequence import SamplingParams, Sequence, Status
from engine_templates.engine.speculative import SpecStats
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
        if config.quantization == "fp8" and self.model_config.fp8 is None:
            self.model_config = dataclasses.replace(self.model_config, fp8=Fp8Scheme())  # per output channel
        self.kernels = KernelSet(config.kernels)
        self.runner = ModelRunner(config, self.model_config, self.kernels, weights)
        self.scheduler = Scheduler(config, BlockManager(self.runner.num_blocks, config.block_size))
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.largest_batch = 0  # the most sequences one step has run: evidence of batching
        self._in_flight: LaunchedStep | None = None  # async decode: queued, tokens not read yet
        self.steps_ahead = 0  # decode steps queued before the previous step's tokens were read
        self.rows_discarded = 0  # rows of such steps whose sequence had ended meanwhile
        self.spec_stats = SpecStats()  # speculative decoding: drafts and accepted tokens
        moe = next((layer for layer in self.runner.model.layers if layer.is_moe), None)
        if moe is not None and isinstance(moe.w_gate_up, torch.Tensor):  # FP8 experts: fp8.fused_moe_fp8
            self.kernels.settle_moe_prefill(moe.w_gate_up, moe.w_down, self.model_config.experts_per_token,
                                            config.torch_dtype)
        if moe is not None and config.moe_prefill == "triton":
            from engine_templates.engine.moe_prefill import MoEPrefill

            self.runner.model.moe_prefill = MoEPrefill(moe.w_gate_up, moe.w_down, self.model_config.experts_per_token,
                                                       self.model_config.norm_topk_prob, config.torch_dtype)
        log.info("engine kernels: %s", self.kernels.choices)

    @property
    def kernel_choices(self) -> dict:
        """Each op's implementation; with FP8 weights also `fp8`: the block scheme, the matmul
        path per kind of scale (fp8.Fp8Linear) and, for a MoE model, the experts' path
        (fp8_moe.Fp8MoE: `moe`, and `moe_dequant_above_tokens` where large calls are dequantized); with
        --moe-prefill triton on a MoE model also `moe_prefill` (moe_prefill.MoEPrefill.choices)."""
        model = self.runner.model
        choices = self.kernels.choices
        if model.moe_prefill is not None:
            choices = choices | {"moe_prefill": model.moe_prefill.choices()}
        fp8 = self.model_config.fp8
        if fp8 is None:
            return choices
        out = {"block": list(fp8.block) if fp8.block else "channel", "linear": model.linear.choices}
        if model.moe_fp8 is not None:
            out |= model.moe_fp8.choices()
        return choices | {"fp8": out}

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
        return self.scheduler.has_work() or self._in_flight is not None

    def step(self) -> list[Sequence]:
        """One model step; returns the sequences that got a token (finished ones included). With
        async decode the step may have been queued by the call before, and the next one is
        queued before this one's tokens are read (module docstring)."""
        step = self._in_flight
        if step is None:
            seqs, is_prefill = self.scheduler.schedule()
            ended = self.scheduler.take_ended()  # finished for want of cache: reported now
            if not seqs:
                return ended
            self.largest_batch = max(self.largest_batch, len(seqs))
            step = self.runner.launch(seqs, is_prefill)
        else:
            ended = []
        self._in_flight = self._launch_ahead(step)
        return ended + self.postprocess(step.seqs, step.results())

    def _launch_ahead(self, step: LaunchedStep) -> LaunchedStep | None:
        """The decode step after `step`, queued before `step`'s tokens are read; None: the next
        step is scheduled once they are in."""
        if not (self.config.async_decode and step.on_graph_path):
            return None
        drafter = self.scheduler.drafter
        if drafter is not None and not all(drafter.idle(s) for s in step.seqs):
            return None  # a step that drafts depends on the tokens the one before accepts
        seqs = self.scheduler.schedule_ahead(step.seqs, lambda s: self._length_reached(s, s.num_tokens + 1))
        if not seqs:
            return None
        self.largest_batch = max(self.largest_batch, len(seqs))
        self.steps_ahead += 1
        return self.runner.launch(seqs, False, after=step)

    def postprocess(self, seqs: list[Sequence], results: list[list[tuple[int, float]]]) -> list[Sequence]:
        """Appends each sequence's new tokens (several after a verify step: speculative.py), up to
        the one that finishes it."""
        updated = []
        for seq, tokens in zip(seqs, results):
            draft, seq.draft = seq.draft, []
            if seq.is_finished:  # ended (or aborted) while this step was in flight: its row is void
                self.rows_discarded += 1
                continue
            accepted = len(tokens) - 1 if draft else 0
            self.spec_stats.add(len(draft), accepted)
            if draft:
                self.scheduler.drafter.verified(seq, accepted)
            # the K/V of rejected drafts stay past the end, to be overwritten
            seq.num_computed_tokens += seq.num_scheduled_tokens - (len(draft) - accepted)
            for token, logprob in tokens:
                seq.token_ids.append(token)
                seq.logprobs.append(logprob)
                reason = self._finish_reason(seq, token)
                if reason:
                    self.scheduler.finish(seq, reason)
                    break
            if tokens:
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
        if self._length_reached(seq, seq.num_tokens):
            return "length"
        return None

    def _length_reached(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` ends when it has `num_tokens` tokens, for want of room."""
        return (num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens
                or num_tokens >= self.config.max_model_len)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[Sequence]:
        """Every prompt to completion, batched; the finished sequences in prompt order."""
        seqs = [self.add_request(p, params) for p in prompts]
        while any(not s.is_finished for s in seqs):
            self.step()
        if self._in_flight is not None and not self.scheduler.has_work():
            self.step()  # a step queued ahead whose rows all ended: waited for, nothing left in flight
        return seqs


def stream_safe_text(seq: Sequence) -> str:
    """The part of the text that later tokens cannot change: an incomplete UTF-8 character at
    the end may still complete, and the last characters may be the start of a stop string."""
    if seq.status is Status.FINISHED:
        return seq.text
    text = seq.text.rstrip("\ufffd")
    hold = max((len(s) for s in seq.params.stop), default=1) - 1
    return text[:len(text) - hold] if hold else text
