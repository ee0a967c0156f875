"""On a GPU: the FP8 engine on each scaled path — block-wise and row-wise scaled matmuls, the MoE
gemv over e4m3 experts — loads, captures a CUDA graph at every decode batch size, decodes at each
the greedy tokens of the engine that dequantizes (but where the bf16 model has a near-tie, which
e4m3 activations may tip), and agrees with the bf16 model within the FP8 threshold; speculative
decoding under CUDA graphs gives the tokens of plain decoding. Skipped where CUDA is not available
(CI); `make gpu-check` runs them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_checkpoints import checkpoint

from engine_templates.engine.bench import FP8_TOLERANCE
from engine_templates.engine.bench.measure import vs_hf
from engine_templates.engine.config import EngineConfig, KernelSpec
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.fp8 import quantize_rows
from engine_templates.engine.oracle import HFOracle
from engine_templates.engine.quantize import quantize_checkpoint
from engine_templates.engine.sequence import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIZES = (1, 2, 4, 8)
PROMPTS = ["The quick brown fox", "Hello world! How are", "Numbers 0 1 2 3 4", "A small engine serves",
           "Paged attention keeps", "Continuous batching lets", "symbols: + - * /", "one token at a time"]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
GEMV = {"fused_moe": KernelSpec(impl="template", template="gemv")}
REPETITIVE = ["id,name,city\n1,ann,oslo\n2,bob,rome\n3,cid,oslo\n4,dan,rome\n5,eve,oslo\n6,",
              "a b c d e f g h a b c d e f g h a b c d e f g h a b c"]


def engine(model_dir, dtype: str = "bf16", eager: bool = False, **settings) -> LLMEngine:
    # num_kv_blocks: several engines in one process (from gpu_memory_utilization the first takes it all)
    return LLMEngine(EngineConfig(model_dir=model_dir, dtype=dtype, device="cuda", max_num_seqs=8,
                                  max_model_len=256, block_size=16, num_kv_blocks=128,
                                  cuda_graph_batch_sizes=SIZES, enforce_eager=eager, **settings))


def at_every_size(eng: LLMEngine, params: SamplingParams = GREEDY) -> list:
    """1, 2, 3 and 8 prompts at once: decode steps of batch 1, 2, 4 (3 padded) and 8."""
    return [s for n in (1, 2, 3, 8) for s in eng.generate(PROMPTS[:n], params)]


def tokens(seqs) -> list[list[int]]:
    return [s.completion_token_ids for s in seqs]


def splits(got, want, oracle) -> list[str]:
    """Where the scaled engine's greedy tokens leave the dequantizing engine's, other than at a
    near-tie of the bf16 model (its two tokens within the FP8 threshold of each other), which the
    scaled matmuls' e4m3 activations may tip either way: [] when nowhere."""
    out = []
    for n, (g, w) in enumerate(zip(tokens(got), tokens(want))):
        i = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if i is None:
            continue
        row = oracle.logprob_rows(got[n].token_ids[:got[n].num_prompt_tokens], w[:i + 1])[i]
        if abs(float(row[g[i]] - row[w[i]])) > FP8_TOLERANCE:
            out.append(f"sequence {n}, token {i}: {g[i]} against {w[i]}, log-probabilities {float(row[g[i]]):.3f} "
                       f"and {float(row[w[i]]):.3f}")
    return out


@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory) -> dict[str, Path]:
    """The wide checkpoints quantized to Qwen's 128 x 128 blocks on the GPU."""
    root = tmp_path_factory.mktemp("fp8-gpu")
    for kind in ("dense", "moe"):
        quantize_checkpoint(checkpoint(kind, wide=True), root / kind, block=128, device="cuda", log=lambda _: None)
    return {kind: root / kind for kind in ("dense", "moe")}


@pytest.mark.parametrize("path", ["blockwise", "rowwise", "moe-gemv"])
def test_the_fp8_engine_on_each_scaled_path_under_cuda_graphs(block_dirs, path):
    kind = "moe" if path == "moe-gemv" else "dense"
    source = checkpoint(kind, wide=True)
    # row-wise: the bf16 checkpoint quantized per output channel at load
    model_dir, settings = (source, {"quantization": "fp8"}) if path == "rowwise" else (block_dirs[kind], {})
    scaled = engine(model_dir, kernels=GEMV if kind == "moe" else {}, **settings)
    fp8 = scaled.kernel_choices["fp8"]
    if kind == "moe":
        assert fp8["moe"].startswith("scaled gemv"), fp8
    assert fp8["linear"]["channel" if path == "rowwise" else "block"] == ("rowwise" if path == "rowwise"
                                                                          else "blockwise"), fp8
    assert scaled.runner.graphs.sizes == list(SIZES)
    got = at_every_size(scaled)

    dequant = engine(model_dir, eager=True, **settings)  # fused_moe eager: its experts dequantized too
    for weights in ("channel", "block"):
        dequant.runner.model.linear.refuse(weights, "the reference of this test")
    want = at_every_size(dequant)
    oracle = HFOracle.from_dir(source, "bf16", "cuda")
    assert splits(got, want, oracle) == []
    prompts = [s.token_ids[:s.num_prompt_tokens] for s in got]
    greedy = [oracle.greedy(p, GREEDY.max_tokens) for p in prompts]
    judged = vs_hf(oracle, prompts, got, greedy, FP8_TOLERANCE)
    assert judged["agree"], judged


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_speculative_decoding_under_cuda_graphs_gives_the_tokens_of_plain_decoding(kind):
    # fp32: verify steps and decode steps then round alike; the MoE on the gemv template, which keeps
    # every batch size under capture
    kernels = GEMV if kind == "moe" else {}
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = REPETITIVE + PROMPTS[:2]
    plain = engine(checkpoint(kind), dtype="fp32", kernels=kernels).generate(prompts, params)
    spec = engine(checkpoint(kind), dtype="fp32", kernels=kernels, spec_tokens=3)
    assert spec.runner.graphs.sizes == sorted(set(SIZES) | {4 * b for b in SIZES})  # verify steps captured
    got = spec.generate(prompts, params)
    assert tokens(got) == tokens(plain)
    stats = spec.spec_stats.as_dict()
    assert stats["accepted_tokens"] > 0 and stats["verify_steps"] < sum(len(t) for t in tokens(got)), stats


@pytest.mark.parametrize("tokens, cols, group, column_major", [
    (1, 4096, 128, True), (40, 768, 128, True), (1, 12288, 12288, False), (64, 4096, 4096, False)])
def test_the_one_kernel_quantization_gives_torchs_bits(tokens, cols, group, column_major):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn((tokens, cols), generator=gen, device="cuda") * torch.logspace(-2, 2, cols, device="cuda"))
    x = x.to(torch.bfloat16)
    q, scale = quantize_rows(x, group, column_major)  # on the GPU: fp8_activations' kernel
    want_q, want_scale = quantize_rows(x.cpu(), group, column_major)  # torch's ops
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale) and scale.stride() == want_scale.stride()
