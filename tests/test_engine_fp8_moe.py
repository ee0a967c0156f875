"""FP8 experts through the fused_moe kernel's fp8 variant: with the `gemv` template chosen, the
engine hands the e4m3 experts and their scales to the scaled kernel (no expert dequantized, seen
through torch's own dispatcher), gives the dequantizing engine's greedy tokens, and stays within
the FP8 thresholds of the bf16 model; calls over the template's token limit, other impls and
scale blocks no tile fits are dequantized, and the engine says so."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine_templates.engine.bench import FP8_TOLERANCE  # noqa: E402
from engine_templates.engine.bench.measure import vs_hf  # noqa: E402
from engine_templates.engine.config import EngineConfig, KernelSpec  # noqa: E402
from engine_templates.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.fp8 import FP8  # noqa: E402
from engine_templates.engine.oracle import HFOracle  # noqa: E402
from engine_templates.engine.quantize import quantize_checkpoint  # noqa: E402
from engine_templates.engine.sequence import SamplingParams  # noqa: E402
from engine_templates.ops.fused_moe import grouped_mm_device  # noqa: E402
from engine_templates.ops.fused_moe.templates import MAX_TOKENS  # noqa: E402
from targets import DEFAULT_LOGPROB_ATOL  # noqa: E402

PROMPTS = ["The quick brown fox", "Hello world! How are", "Numbers 0 1 2 3 4"]
# one program per (token, slot) pair in each pass at hidden 64, intermediate 32: the interpreter's cost
POINT = {"block_i": 32, "block_h": 64, "block_o": 64, "block_k": 32, "num_warps": 1}
GEMV = {"fused_moe": KernelSpec(impl="template", template="gemv", point=POINT)}


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> dict[int, Path]:
    """block -> the tiny MoE checkpoint quantized: Qwen's 128 x 128 blocks (wider than the tiny
    model: one scale per expert row) and 16 x 16 (narrower than every tile of the template)."""
    root = tmp_path_factory.mktemp("fp8-moe")
    for block in (128, 16):
        quantize_checkpoint(checkpoint("moe"), root / str(block), block=block, device="cpu", log=lambda _: None)
    return {block: root / str(block) for block in (128, 16)}


def engine(model_dir: Path, kernels=None, dtype: str = "fp32", **settings) -> LLMEngine:
    settings = {"max_model_len": 128, "max_num_seqs": 4} | settings
    return LLMEngine(EngineConfig(model_dir=model_dir, dtype=dtype, device="cpu", kernels=kernels or {}, **settings))


class ExpertsWidened(TorchDispatchMode):
    """Every aten op run inside that turns an e4m3 stack of experts (3-D: the linear layers'
    weights are 2-D) into a wider dtype: a dequantized expert weight materialised."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        experts = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.dtype == FP8
                   and a.dim() == 3]
        if experts and any(isinstance(o, torch.Tensor) and o.dtype != FP8 for o in tree_leaves(out)):
            self.seen.append(f"{func} {tuple(experts[0].shape)}")
        return out


def generate(eng: LLMEngine, tokens: int = 8):
    with ExpertsWidened() as widened:
        seqs = eng.generate(PROMPTS, SamplingParams(max_tokens=tokens, ignore_eos=True))
    return seqs, widened.seen


@pytest.mark.parametrize("layout", ["checkpoint-128", "at-load"])
def test_fp8_experts_run_the_scaled_gemv_and_give_the_dequantized_tokens(fp8_dirs, layout):
    model_dir, settings = ((fp8_dirs[128], {}) if layout == "checkpoint-128"
                           else (checkpoint("moe"), {"quantization": "fp8"}))  # per output channel
    scaled = engine(model_dir, GEMV, **settings)
    # float32 activations: no grouped GEMMs, so the scaled kernel takes every call, prefills too
    assert scaled.kernel_choices["fp8"]["moe"] == "scaled gemv"
    assert "moe_dequant_above_tokens" not in scaled.kernel_choices["fp8"]
    got, widened = generate(scaled)
    calls = scaled.runner.model.moe_fp8.calls
    assert widened == [] and calls["dequant"] == 0 and calls["scaled"] >= 8  # one MoE layer, 8 steps

    dequant = engine(model_dir, **settings)
    assert dequant.kernel_choices["fp8"]["moe"] == "dequant (fused_moe is eager, which takes bf16 experts)"
    want, widened = generate(dequant)
    assert widened and dequant.runner.model.moe_fp8.calls == {"scaled": 0, "dequant": calls["scaled"]}
    assert [s.completion_token_ids for s in got] == [s.completion_token_ids for s in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4

    # judged against the bf16 model: within the FP8 thresholds, beyond bf16's
    oracle = HFOracle.from_dir(checkpoint("moe"), "fp32")
    prompts = [s.token_ids[:s.num_prompt_tokens] for s in got]
    greedy = [oracle.greedy(p, 8) for p in prompts]
    assert vs_hf(oracle, prompts, got, greedy, FP8_TOLERANCE)["agree"]
    assert FP8_TOLERANCE == DEFAULT_LOGPROB_ATOL["fp8"]
    assert not vs_hf(oracle, prompts, got, greedy, DEFAULT_LOGPROB_ATOL["bf16"])["agree"]


def test_scaled_fp8_experts_keep_every_decode_graph_size(fp8_dirs):
    # The scaled kernel never syncs with the host: decode graphs for every batch, where the
    # dequantized experts keep them to batches whose tokens * top_k fit the 8 experts.
    scaled, dequant = engine(fp8_dirs[128], GEMV, max_num_seqs=8), engine(fp8_dirs[128], max_num_seqs=8)
    graphs = DecodeGraphs(scaled.runner, scaled.model_config, capture=False)
    assert graphs.sizes == [1, 2, 4, 8]
    assert DecodeGraphs(dequant.runner, dequant.model_config, capture=False).sizes == [1, 2, 4]
    plain, _ = generate(scaled, 4)
    scaled.runner.graphs = graphs
    graphed, widened = generate(scaled, 4)
    assert widened == [] and [s.completion_token_ids for s in graphed] == [s.completion_token_ids for s in plain]


def test_fp8_experts_are_dequantized_only_where_no_fp8_kernel_applies(fp8_dirs):
    narrow = engine(fp8_dirs[16], GEMV)
    assert narrow.kernel_choices["fp8"]["moe"] == ("dequant (w_gate_up scale blocks are 16 columns wide: "
                                                   "no block_h of [32, 64, 128] up to 64 lies in one)")
    assert engine(fp8_dirs[16], {"fused_moe": KernelSpec(impl="reference")}).kernel_choices["fp8"]["moe"] == \
        "dequant (fused_moe is reference, which takes bf16 experts)"
    # the bf16 template's default point (256-column tiles) narrowed to the fp8 template's 128
    wide = engine(fp8_dirs[128], {"fused_moe": KernelSpec(impl="template", template="gemv")})
    assert wide.kernel_choices["fp8"]["moe"] == "scaled gemv (block_h 256 -> 128, block_k 256 -> 128)"
    if not grouped_mm_device(torch.device("cpu")):
        return  # this torch has no CPU torch._grouped_mm: the scaled kernel keeps every call
    # bf16: a prompt over the template's token limit is dequantized for eager's grouped GEMMs
    eng = engine(fp8_dirs[128], GEMV, "bf16", max_num_batched_tokens=256)
    assert eng.kernel_choices["fp8"]["moe_dequant_above_tokens"] == MAX_TOKENS
    long = "Paged attention keeps the cache in blocks; the scheduler batches requests. " * 3
    seq = eng.generate([long], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert seq.num_prompt_tokens > MAX_TOKENS
    assert eng.runner.model.moe_fp8.calls == {"scaled": 2, "dequant": 1}  # the two decode steps, the prompt
