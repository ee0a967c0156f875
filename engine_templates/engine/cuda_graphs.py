"""Decode steps replayed from CUDA graphs, one per batch size, on a GPU only.

A batch of n sequences replays the smallest captured size >= n; the padding rows read the
scratch block (length 1) and write their K/V there, so they cost a little work and touch no
sequence's cache. Graphs are captured after one eager warm-up (Triton compiles then), largest
first, sharing one memory pool. Not exercised on a CPU: ModelRunner builds this only when the
device is CUDA and enforce_eager is off.
"""
from __future__ import annotations

import torch

from engine_templates.engine.config import ModelConfig
from engine_templates.engine.model import AttentionInputs
from engine_templates.engine.sequence import Sequence


class DecodeGraphs:
    def __init__(self, runner, cfg: ModelConfig):
        self.runner = runner
        model, config = runner.model, runner.config
        sizes = [b for b in config.cuda_graph_batch_sizes if b <= config.max_num_seqs]
        if cfg.is_moe and model.k.choices["fused_moe"]["impl"] == "eager":
            # The eager MoE syncs with the host once tokens * top_k exceed the experts.
            sizes = [b for b in sizes if b * cfg.experts_per_token <= cfg.experts]
        self.sizes = sorted(sizes)
        if not self.sizes:
            return
        dev, max_bs = runner.device, self.sizes[-1]
        scratch = runner.scratch_block
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), scratch * runner.block_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.block_table = torch.full((max_bs, runner.max_blocks_per_seq), scratch, dtype=torch.int32,
                                      device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up: compiles kernels and settles allocations outside capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(dev)

    def _forward(self, bs: int) -> torch.Tensor:
        attn = AttentionInputs(False, self.slot_mapping[:bs], self.seq_lens[:bs], self.block_table[:bs])
        model = self.runner.model
        return model.compute_logits(model.forward(self.input_ids[:bs], self.positions[:bs], attn))

    def fits(self, n: int) -> bool:
        return bool(self.sizes) and n <= self.sizes[-1]

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        n = len(seqs)
        bs = next(b for b in self.sizes if b >= n)
        ids, positions, attn = self.runner.prepare_decode(seqs)
        self.input_ids[:n] = ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = attn.slot_mapping
        self.slot_mapping[n:bs] = self.runner.scratch_block * self.runner.block_size
        self.seq_lens[:n] = attn.seq_lens
        self.seq_lens[n:bs] = 1
        self.block_table[:bs] = self.runner.scratch_block
        self.block_table[:n, :attn.block_table.shape[1]] = attn.block_table
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:n]
