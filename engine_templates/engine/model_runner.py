"""Runs the model on a scheduled batch: builds its inputs, owns the KV cache and the CUDA
graphs, samples on the device, and brings back one small tensor of tokens per step.

`launch` queues a step and returns a LaunchedStep without waiting for the device: its tokens
come back into pinned host memory behind an event, read by `LaunchedStep.results()`. Host
inputs go up from pinned memory too, so nothing in a decode step on the graph path waits for
the device, and the next step can be queued behind one still running (async decode, engine.py).
"""
from __future__ import annotations

import torch

from engine_templates.engine.config import EngineConfig, ModelConfig
from engine_templates.engine.kernels import KernelSet
from engine_templates.engine.loader import load_weights
from engine_templates.engine.model import AttentionInputs, DecoderModel
from engine_templates.engine.sampler import Sampler, to_device
from engine_templates.engine.sequence import Sequence
from engine_templates.engine.speculative import accept
from engine_templates.ops.rope import cos_sin_table


class LaunchedStep:
    """A step queued on the device, and where its tokens will be."""

    def __init__(self, seqs: list[Sequence], samples: list[bool], on_graph_path: bool,
                 tokens: torch.Tensor | None, host: torch.Tensor | None, event: torch.cuda.Event | None):
        self.seqs = seqs
        self.samples = samples  # per sequence: whether the step samples its next token
        self.on_graph_path = on_graph_path  # a decode step through DecodeGraphs: one can be queued behind it
        self.tokens = tokens  # the sampled tokens, on the device (the input ids of a step queued behind)
        self.row = {s.seq_id: i for i, s in enumerate(s for s, yes in zip(seqs, samples) if yes)}
        self._host, self._event = host, event  # tokens and log-probabilities, once the event has passed

    def results(self) -> list[list[tuple[int, float]]]:
        """Per sequence: its new tokens with their log-probabilities — one; none for a prompt chunk
        that does not reach the end of its sequence; 1 + accepted drafts after a verify
        (speculative.accept). Waits for the step (only) when it must."""
        if self._host is None:
            return [[] for _ in self.seqs]
        if self._event is not None:
            self._event.synchronize()
        picked = iter(zip(self._host[0].long().tolist(), self._host[1].tolist()))
        return [accept(s.draft, [next(picked) for _ in range(1 + len(s.draft))]) if yes else []
                for s, yes in zip(self.seqs, self.samples)]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, kernels: KernelSet,
                 weights: dict[str, torch.Tensor] | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        torch.manual_seed(config.seed)
        cos_sin = cos_sin_table(model_config.head_dim, config.max_model_len, model_config.rope_theta,
                                device=self.device, llama3=model_config.rope_scaling)
        # A window the served context fits in changes nothing: the full-attention ops then serve it.
        window = model_config.sliding_window
        self.model = DecoderModel(model_config, kernels, cos_sin, config.torch_dtype, config.device,
                                  weights, window if window is not None and window < config.max_model_len else None)
        if weights is None:
            load_weights(self.model, config.model_dir)
        self.num_blocks = self._allocate_kv_cache(model_config)
        # One block past the allocator's: padded rows of a captured decode batch write there.
        self.scratch_block = self.num_blocks
        self.sampler = Sampler(config.device, config.seed)
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from engine_templates.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, model_config)

    def _allocate_kv_cache(self, cfg: ModelConfig) -> int:
        per_block = 2 * cfg.layers * self.block_size * cfg.kv_heads * cfg.head_dim * \
            self.config.torch_dtype.itemsize
        if self.config.num_kv_blocks:
            blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
            blocks = int(budget // per_block)
            assert blocks > 0, "no GPU memory left for the KV cache"
        else:
            blocks = self.config.max_num_seqs * self.max_blocks_per_seq
        # Zeros, not empty: a masked-out cache slot still enters a softmax-weighted sum as
        # 0 * value, and NaN bits left in recycled memory would turn that into NaN.
        self.model.kv_cache = torch.zeros(
            (cfg.layers, 2, blocks + 1, self.block_size, cfg.kv_heads, cfg.head_dim),
            dtype=self.config.torch_dtype, device=self.device)
        return blocks

    def _block_table(self, seqs: list[Sequence], rows: int | None = None) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        table = [s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in seqs]
        table += [[self.scratch_block] * width] * ((rows or len(seqs)) - len(seqs))
        return self._to_device(table, torch.int32)

    def _to_device(self, values, dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare_prefill(self, seqs: list[Sequence]):
        ids, positions, slots, cu, seq_lens, last = [], [], [], [0], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(seq, start, end)
            cu.append(cu[-1] + end - start)
            seq_lens.append(end)
            last.append(cu[-1] - 1)
        attn = AttentionInputs(True, self._to_device(slots, torch.int64),
                               self._to_device(seq_lens, torch.int32), self._block_table(seqs),
                               self._to_device(cu, torch.int32))
        return (self._to_device(ids, torch.int64), self._to_device(positions, torch.int64), attn,
                self._to_device(last, torch.int64))

    def prepare_decode(self, seqs: list[Sequence], after: LaunchedStep | None = None):
        """Each sequence's last token at its position, then its draft's tokens at theirs (one row
        each: speculative.py). With `after` (a decode step still in flight), the last token is the
        one that step samples: not appended yet, so one position further than `token_ids` says,
        and taken from that step's tokens on the device."""
        lengths = [s.num_tokens + (after is not None) for s in seqs]
        if after is None:
            ids = self._to_device([t for s in seqs for t in [s.token_ids[-1], *s.draft]], torch.int64)
        else:
            assert not any(s.draft for s in seqs), "a draft needs the tokens of the step before"
            rows = self._to_device([after.row[s.seq_id] for s in seqs], torch.int64)
            ids = after.tokens.index_select(0, rows)
        ends = [n + j for s, n in zip(seqs, lengths) for j in range(1 + len(s.draft))]  # each row's cache length
        owners = [s for s in seqs for _ in range(1 + len(s.draft))]
        slots = [self._slots(s, n - 1, n)[0] for s, n in zip(owners, ends)]
        attn = AttentionInputs(False, self._to_device(slots, torch.int64),
                               self._to_device(ends, torch.int32), self._block_table(owners))
        return ids, self._to_device([n - 1 for n in ends], torch.int64), attn

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[tuple[int, float] | None]:
        """The step, waited for: LaunchedStep.results()."""
        return self.launch(seqs, is_prefill).results()

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queues the step (sampling included) and returns without waiting for the device.
        `after`: a decode step on the graph path still in flight, whose tokens are `seqs`' inputs
        (see prepare_decode); the step then runs on the graph path too."""
        rows = sum(1 + len(s.draft) for s in seqs)
        graphed = not is_prefill and self.graphs is not None and self.graphs.fits(rows)
        assert after is None or (graphed and after.on_graph_path)
        if is_prefill:
            ids, positions, attn, last = self.prepare_prefill(seqs)
            hidden = self.model.forward(ids, positions, attn)
            logits = self.model.compute_logits(hidden[last])
        elif graphed:
            logits = self.graphs.run(seqs, after)
        else:
            ids, positions, attn = self.prepare_decode(seqs)
            logits = self.model.compute_logits(self.model.forward(ids, positions, attn))
        samples = [s.samples_after_step for s in seqs]
        picked = [i for i, yes in enumerate(samples) if yes]
        if not picked:
            return LaunchedStep(seqs, samples, graphed, None, None, None)
        if len(picked) < len(seqs):  # prefill: a row per sequence, some of them mid-prompt
            logits = logits[picked]
        # a row per sampled sequence, and one more per draft token of a verify step
        tokens, logprobs = self.sampler(logits, [seqs[i] for i in picked for _ in range(1 + len(seqs[i].draft))])
        # The step's one device-to-host transfer: tokens (exact in float64) and log-probabilities,
        # into pinned memory, so that it does not wait; the event says when it has landed.
        out = torch.stack((tokens.double(), logprobs.double()))
        if self.device.type != "cuda":
            return LaunchedStep(seqs, samples, graphed, tokens, out, None)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the copy's stream, whichever device is current
        return LaunchedStep(seqs, samples, graphed, tokens, host, event)
