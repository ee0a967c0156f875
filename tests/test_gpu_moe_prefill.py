"""On a GPU: the Triton grouped GEMMs for MoE prefill compiled and run (bf16 and e4m3 experts)
against the op's reference at a qwen3-30b-a3b-like width, the engine with --moe-prefill triton
agreeing with transformers, and `engine bench --profile`'s device-time path (kernels linked to
their launches, graph replays by name). Skipped where CUDA is not available (CI); `make gpu-check`
runs them."""
from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import checkpoint

from contract.job import Shape
from engine_templates.engine.bench.measure import vs_hf
from engine_templates.engine.bench.op_profile import CATEGORIES, profile_engine
from engine_templates.engine.config import EngineConfig
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.fp8 import quantize
from engine_templates.engine.oracle import HFOracle
from engine_templates.engine.sequence import SamplingParams
from engine_templates.ops.fused_moe import OP
from engine_templates.ops.fused_moe.grouped import DEFAULT, launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_kernel_on_the_gpu_matches_the_reference(fp8):
    shape = Shape("prefill_150", {"tokens": 150, "hidden": 256, "inter": 128, "experts": 64, "top_k": 8})
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, logits, w_gate_up, w_down, top_k, renorm = OP.inputs(shape, torch.bfloat16, "cuda", gen, "normal")
    if fp8:
        gu, d = quantize(w_gate_up.float(), (128, 128)), quantize(w_down.float(), (128, 128))
        got = launch(x, logits, gu.q, gu.scale, d.q, d.scale, top_k, renorm, **DEFAULT, gu_block=gu.block,
                     d_block=d.block)
        want = OP.reference(x, logits, gu.dequantize(torch.float32), d.dequantize(torch.float32), top_k, renorm)
    else:
        got = launch(x, logits, w_gate_up, None, w_down, None, top_k, renorm, **DEFAULT)
        want = OP.reference(x, logits, w_gate_up, w_down, top_k, renorm)
    assert rel(got, want) < 1.6e-2


def engine(**settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=checkpoint("moe"), dtype="bf16", device="cuda", max_num_seqs=2,
                                  max_model_len=256, max_num_batched_tokens=256, num_kv_blocks=64,
                                  cuda_graph_batch_sizes=(1, 2), **settings))


@pytest.mark.parametrize("quantization", ["", "fp8"])
def test_engine_with_the_grouped_kernel_agrees_with_transformers(quantization):
    eng = engine(moe_prefill="triton", quantization=quantization)
    assert eng.kernel_choices["moe_prefill"]["path"] == "triton grouped"
    prompts = ["Paged attention keeps the cache in blocks; the scheduler batches requests. " * 3, "Hello world!"]
    seqs = eng.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert eng.runner.model.moe_prefill.calls["triton"] == 1
    oracle = HFOracle.from_dir(checkpoint("moe"), "bf16")
    ids = [s.token_ids[:s.num_prompt_tokens] for s in seqs]
    assert vs_hf(oracle, ids, seqs, [oracle.greedy(p, 4) for p in ids], 0.5 if quantization else 0.1)["agree"]


def test_profile_on_the_gpu_reads_device_time_per_category():
    eng = engine(moe_prefill="triton")
    prof = profile_engine(eng, (100,), 16, eng.model_config.vocab, 0)
    for step, p in prof.items():
        cats = p["categories_us"]
        assert p["device"] == "cuda" and list(cats) == list(CATEGORIES)
        assert sum(cats.values()) == pytest.approx(p["busy_us"], rel=1e-2)  # each kernel counted once
        assert p["busy_us"] > 0 and cats["attention"] > 0 and cats["moe_gemm"] > 0, (step, cats)
    assert prof["decode_b1"]["graphs"]
