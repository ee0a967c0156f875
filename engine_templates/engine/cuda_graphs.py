"""Decode steps replayed from CUDA graphs, one per (batch size, block-table width), on a GPU.

A batch of n rows (a row per sequence, and one per draft token of speculative decoding) whose
longest block table has w blocks replays the smallest captured size >= n and the narrowest
captured width >= w. Widths are powers of two from 8 blocks up to the model length: an op that
reads every table entry (the eager decode attention gathers them all) then pays for the longest
sequence of the batch rounded up, not for the model length.
Padding rows read the scratch block (length 1) and write their K/V there, so they cost a
little work and touch no sequence's cache. Each graph is captured after one eager warm-up
(Triton compiles then), largest first, all sharing one memory pool.

With capture=False the same static buffers, padding and width buckets are used but each step
runs eagerly on them: that is how a CPU (which has no graphs) tests this bookkeeping.
"""
from __future__ import annotations

import torch

from engine_templates.engine.config import ModelConfig
from engine_templates.engine.model import AttentionInputs
from engine_templates.engine.sequence import Sequence

MIN_WIDTH = 8  # blocks


class DecodeGraphs:
    def __init__(self, runner, cfg: ModelConfig, capture: bool = True):
        self.runner = runner
        model, config = runner.model, runner.config
        sizes = {b for b in config.cuda_graph_batch_sizes if b <= config.max_num_seqs}
        # A verify step of speculative decoding is a decode batch of 1 + spec_tokens rows a sequence.
        sizes |= {b * (1 + config.spec_tokens) for b in sizes}
        dequantized = model.moe_fp8 is not None and model.moe_fp8.scaled is None
        if cfg.is_moe and (model.k.choices["fused_moe"]["impl"] == "eager" or dequantized):
            # The eager MoE (and the dequantized FP8 one, beyond its gather path) syncs with the
            # host once tokens * top_k exceed the experts; the scaled FP8 kernel never does.
            sizes = {b for b in sizes if b * cfg.experts_per_token <= cfg.experts}
        self.sizes = sorted(sizes)
        max_w = runner.max_blocks_per_seq
        self.widths = sorted({min(MIN_WIDTH << i, max_w) for i in range(max_w.bit_length() + 1)})
        if not self.sizes:
            return
        dev, max_bs = runner.device, self.sizes[-1]
        scratch = runner.scratch_block
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), scratch * runner.block_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.block_table = torch.full((max_bs, max_w), scratch, dtype=torch.int32, device=dev)
        # (batch size, width) -> (graph, its logits); no graph when not capturing
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        pool = None
        for bs in reversed(self.sizes):
            for width in reversed(self.widths):
                if not capture:
                    self.graphs[bs, width] = (None, None)
                    continue
                self._forward(bs, width)  # warm-up: compiles kernels, settles allocations
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(bs, width)
                pool = graph.pool()
                self.graphs[bs, width] = (graph, logits)
        if capture:
            torch.cuda.synchronize(dev)

    def _forward(self, bs: int, width: int) -> torch.Tensor:
        attn = AttentionInputs(False, self.slot_mapping[:bs], self.seq_lens[:bs],
                               self.block_table[:bs, :width])
        model = self.runner.model
        return model.compute_logits(model.forward(self.input_ids[:bs], self.positions[:bs], attn))

    def fits(self, n: int) -> bool:
        return bool(self.sizes) and n <= self.sizes[-1]

    def run(self, seqs: list[Sequence], after=None) -> torch.Tensor:
        """Logits of the decode step, a row per sequence and per draft token; `after`: see
        ModelRunner.prepare_decode."""
        ids, positions, attn = self.runner.prepare_decode(seqs, after)
        n = ids.shape[0]
        bs = next(b for b in self.sizes if b >= n)
        w = attn.block_table.shape[1]
        width = next(x for x in self.widths if x >= w)
        self.input_ids[:n] = ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = attn.slot_mapping
        self.slot_mapping[n:bs] = self.runner.scratch_block * self.runner.block_size
        self.seq_lens[:n] = attn.seq_lens
        self.seq_lens[n:bs] = 1
        self.block_table[:bs, :width] = self.runner.scratch_block
        self.block_table[:n, :w] = attn.block_table
        graph, logits = self.graphs[bs, width]
        if graph is None:
            return self._forward(bs, width)[:n]
        graph.replay()
        return logits[:n]
