"""The Triton grouped GEMMs for MoE prefill (ops/fused_moe/grouped.py) against the op's float64
reference under the interpreter — uneven tokens per expert, an idle expert, top-k 2 and 8, bf16,
float32 and FP8 experts — and the engine with them (--moe-prefill triton) against without:
the same greedy tokens, the path named in its choices, the engine's own path where the kernel is
refused at start or raises later."""
from __future__ import annotations

import os

import pytest
import torch
from tiny_checkpoints import checkpoint

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine_templates.engine.bench.measure import vs_hf  # noqa: E402
from engine_templates.engine.config import EngineConfig, EngineSetupError  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.fp8 import quantize  # noqa: E402
from engine_templates.engine.moe_prefill import ABOVE, MoEPrefill  # noqa: E402
from engine_templates.engine.sequence import SamplingParams  # noqa: E402
from engine_templates.ops.fused_moe import OP, loop_moe  # noqa: E402
from engine_templates.ops.fused_moe.grouped import build, launch, tile_map, usable  # noqa: E402

SMALL = dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)  # the interpreter's cost
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def skewed(tokens: int, experts: int, top_k: int, idle: int, dtype, seed: int = 0):
    """Router logits, distinct multiples of 1/32 (no ties): expert 0 in every token's top_k, the
    rest by a random key skewed towards low indices, expert `idle` in none."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.rand((tokens, experts), generator=gen) - torch.arange(experts) / experts
    key[:, 0], key[:, idle] = 10.0, -10.0
    ranks = key.argsort(dim=1).argsort(dim=1)  # 0 lowest
    return (ranks.float() / 32).to(dtype)


def moe_inputs(tokens, hidden, inter, experts, top_k, dtype, idle=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((tokens, hidden), generator=gen).to(dtype)
    w_gate_up = (torch.randn((experts, 2 * inter, hidden), generator=gen) * hidden ** -0.5).to(dtype)
    w_down = (torch.randn((experts, hidden, inter), generator=gen) * inter ** -0.5).to(dtype)
    return x, skewed(tokens, experts, top_k, idle, dtype, seed), w_gate_up, w_down


def rel(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_tile_map_covers_every_pair_once_in_tiles_of_one_expert():
    experts, block_m = 6, 4
    routed = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 5], [0, 1], [0, 2], [5, 0]])  # expert 3 and 4 idle
    order, ends, tile_expert, tile_row = tile_map(routed, experts, block_m)
    flat = routed.flatten()
    assert sorted(order.tolist()) == list(range(flat.numel()))
    assert ends.tolist() == [7, 10, 12, 12, 12, 14]  # 7 pairs of expert 0, 3 of 1, 2 of 2, 2 of 5
    real = [(e, r) for e, r in zip(tile_expert.tolist(), tile_row.tolist()) if e < experts]
    # expert 0: rows 0-3 and 4-6; then one tile each for 1, 2 and 5; none for the idle experts
    assert real == [(0, 0), (0, 4), (1, 7), (2, 10), (5, 12)]
    assert len(tile_expert) == -(-flat.numel() // block_m) + experts  # the grid's bound
    assert all(e == experts for e in tile_expert.tolist()[len(real):])  # past the last: no expert
    for e, start in real:  # a tile's rows are all routed to its expert
        rows = order[start:min(start + block_m, ends[e])].long()
        assert (flat[rows] == e).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [2, 8])
def test_grouped_kernel_matches_the_reference(dtype, top_k):
    x, logits, w_gate_up, w_down = moe_inputs(37, 64, 32, 16, top_k, dtype)
    got = build(**SMALL)(x, logits, w_gate_up, w_down, top_k, True)
    want = OP.reference(x, logits, w_gate_up, w_down, top_k, True)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel(got, want) < TOL[dtype]
    # expert 0 has all 37 tokens (three tiles, the last partial), expert 3 none
    _, experts = torch.topk(logits.float(), top_k)
    assert (experts == 0).any(dim=1).all() and not (experts == 3).any()


def test_grouped_kernel_without_renormalizing_and_with_odd_sizes():
    x, logits, w_gate_up, w_down = moe_inputs(19, 40, 24, 8, 2, torch.float32)  # no size a multiple of 16
    got = build(**SMALL)(x, logits, w_gate_up, w_down, 2, False)
    assert rel(got, OP.reference(x, logits, w_gate_up, w_down, 2, False)) < TOL[torch.float32]


@pytest.mark.parametrize("block", [(16, 16), (1, 0), (128, 128)])
def test_grouped_kernel_over_fp8_experts_applies_their_block_scales(block):
    """e4m3 experts with their scales: 16 x 16 blocks (a K step per block column), one scale per
    row (`(1, 0)`: the whole width), and 128 x 128 blocks wider than the experts."""
    x, logits, w_gate_up, w_down = moe_inputs(29, 64, 32, 8, 2, torch.bfloat16)
    gu = quantize(w_gate_up.float(), (block[0], block[1] or 64))
    d = quantize(w_down.float(), (block[0], block[1] or 32))
    got = launch(x, logits, gu.q, gu.scale, d.q, d.scale, 2, True, **SMALL, gu_block=gu.block, d_block=d.block)
    want = OP.reference(x, logits, gu.dequantize(torch.float32), d.dequantize(torch.float32), 2, True)
    assert rel(got, want) < TOL[torch.bfloat16]
    unscaled = launch(x, logits, gu.q, None, d.q, None, 2, True, **SMALL)  # the scales matter
    assert rel(unscaled, want) > 0.5


def test_grouped_kernel_refuses_a_k_step_across_scale_blocks():
    x, _, w_gate_up, w_down = moe_inputs(4, 64, 32, 8, 2, torch.bfloat16)
    gu, d = quantize(w_gate_up.float(), (16, 16)), quantize(w_down.float(), (16, 16))
    assert usable(x, gu.q, d.q, gu.scale, d.scale, gu.block, d.block, 16) is None
    why = usable(x, gu.q, d.q, gu.scale, d.scale, gu.block, d.block, 32)
    assert why is not None and "K step of 32" in why


def engine(dtype: str, model_dir=None, **settings) -> LLMEngine:
    settings = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=256, block_size=4) | settings
    return LLMEngine(EngineConfig(model_dir=model_dir or checkpoint("moe"), dtype=dtype, device="cpu",
                                  **settings))


PROMPTS = ["Paged attention keeps the cache in blocks; the scheduler batches requests. " * 3, "Hello world!"]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def test_engine_with_the_grouped_kernel_gives_the_same_greedy_tokens():
    """float32: the Triton grouped GEMMs take the long prompt's MoE call (one MoE layer), the rest
    the engine's own path, and the tokens and log-probabilities are those without them."""
    on, off = engine("fp32", moe_prefill="triton"), engine("fp32")
    choice = on.kernel_choices["moe_prefill"]
    assert choice["path"] == "triton grouped" and choice["above_tokens"] == ABOVE
    assert "moe_prefill" not in off.kernel_choices
    got, want = on.generate(PROMPTS, PARAMS), off.generate(PROMPTS, PARAMS)
    assert got[0].num_prompt_tokens > ABOVE
    assert on.runner.model.moe_prefill.calls == {"triton": 1, "fallback": 0}
    assert [s.completion_token_ids for s in got] == [s.completion_token_ids for s in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


def test_engine_with_the_grouped_kernel_agrees_with_transformers_in_bf16():
    from engine_templates.engine.oracle import HFOracle

    on = engine("bf16", moe_prefill="triton")
    seqs = on.generate(PROMPTS, PARAMS)
    assert on.runner.model.moe_prefill.calls["triton"] == 1
    oracle = HFOracle.from_dir(checkpoint("moe"), "bf16")
    prompts = [s.token_ids[:s.num_prompt_tokens] for s in seqs]
    result = vs_hf(oracle, prompts, seqs, [oracle.greedy(p, 4) for p in prompts], 0.1)
    assert result["agree"], result


def test_engine_with_the_grouped_kernel_over_fp8_experts(tmp_path):
    """FP8 experts quantized at load (one scale per output channel): the prompt's call reads the
    e4m3 experts in the kernel, and the tokens are the dequantizing engine's."""
    on, off = engine("fp32", moe_prefill="triton", quantization="fp8"), engine("fp32", quantization="fp8")
    assert on.kernel_choices["moe_prefill"]["path"] == "triton grouped"
    got, want = on.generate(PROMPTS, PARAMS), off.generate(PROMPTS, PARAMS)
    assert on.runner.model.moe_prefill.calls["triton"] == 1
    assert [s.completion_token_ids for s in got] == [s.completion_token_ids for s in want]


def test_a_kernel_refused_at_start_leaves_the_engines_path_and_says_why(tmp_path):
    from engine_templates.engine.quantize import quantize_checkpoint

    fp8_16 = tmp_path / "fp8-16"
    quantize_checkpoint(checkpoint("moe"), fp8_16, block=16, device="cpu", log=lambda _: None)
    on, off = engine("fp32", fp8_16, moe_prefill="triton"), engine("fp32", fp8_16)
    path = on.kernel_choices["moe_prefill"]["path"]
    assert path.startswith("torch (triton refused: the grouped kernel does not take scale blocks"), path
    got, want = on.generate(PROMPTS, PARAMS), off.generate(PROMPTS, PARAMS)
    assert on.runner.model.moe_prefill.calls == {"triton": 0, "fallback": 1}
    assert [s.completion_token_ids for s in got] == [s.completion_token_ids for s in want]


def test_a_kernel_that_fails_its_probe_is_refused():
    _, _, w_gate_up, w_down = moe_inputs(4, 64, 32, 8, 2, torch.float32)
    # tl.arange needs a power of two: Triton refuses to build it
    bad = MoEPrefill(w_gate_up, w_down, 2, True, torch.float32, point=SMALL | {"block_m": 24})
    assert not bad.on and bad.path.startswith("torch (triton refused: raised at 65 tokens:"), bad.path
    good = MoEPrefill(w_gate_up, w_down, 2, True, torch.float32, point=SMALL)
    assert good.on and good.path == "triton grouped"


def test_a_call_that_raises_goes_to_the_engines_path_and_the_kernel_is_refused():
    x, logits, w_gate_up, w_down = moe_inputs(ABOVE + 3, 64, 32, 8, 2, torch.float32)
    prefill = MoEPrefill(w_gate_up, w_down, 2, True, torch.float32, point=SMALL)
    assert prefill.takes(x) and not prefill.takes(x[:ABOVE])
    columns = torch.stack((x, x), dim=2)[:, :, 0]  # x's values, rows not contiguous: the launcher refuses them
    out = prefill(columns, logits, w_gate_up, w_down, 2, True, loop_moe)
    torch.testing.assert_close(out, loop_moe(x, logits, w_gate_up, w_down, 2, True))
    assert not prefill.on and "raised at 67 tokens: AssertionError" in prefill.path
    prefill(x, logits, w_gate_up, w_down, 2, True, loop_moe)  # refused: every later call too
    assert prefill.calls == {"triton": 0, "fallback": 2}


def test_moe_prefill_option_is_checked():
    with pytest.raises(EngineSetupError, match="--moe-prefill must be one of torch, triton"):
        EngineConfig(moe_prefill="cutlass")


def test_moe_prefill_reaches_the_engine_config_and_the_bench(capsys):
    import argparse

    from engine_templates.engine.cli import add_commands, engine_config

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    for base in (["serve", "--model-dir", str(checkpoint("moe"))],
                 ["generate", "--model-dir", str(checkpoint("moe")), "--prompt", "x"]):
        assert engine_config(parser.parse_args(base)).moe_prefill == "torch"
        assert engine_config(parser.parse_args(base + ["--moe-prefill", "triton"])).moe_prefill == "triton"
    assert parser.parse_args(["bench", "--out", "x", "--moe-prefill", "triton"]).moe_prefill == "triton"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["bench", "--out", "x", "--moe-prefill", "cutlass"])
    assert exit_.value.code == 2 and "invalid choice: 'cutlass'" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's bf16 dot")
def test_a_kernel_that_disagrees_at_its_probe_is_refused(monkeypatch):
    """Without the interpreter's upcast its dot multiplies bf16 operands as raw bits (grouped.py's
    docstring): a kernel that runs and answers wrongly, which the probe must catch."""
    from engine_templates.ops.fused_moe import grouped

    _, _, w_gate_up, w_down = moe_inputs(4, 64, 32, 8, 2, torch.bfloat16)
    monkeypatch.setattr(grouped, "UPCAST", False)
    wrong = MoEPrefill(w_gate_up, w_down, 2, True, torch.bfloat16, point=SMALL)
    assert not wrong.on and wrong.path.startswith("torch (triton refused: disagreed at 65 tokens: relative error")
    monkeypatch.setattr(grouped, "UPCAST", True)
    assert MoEPrefill(w_gate_up, w_down, 2, True, torch.bfloat16, point=SMALL).on
