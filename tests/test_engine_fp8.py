"""FP8 (e4m3) weights: quantization within e4m3's rounding for every block layout, the scaled-matmul
path agreeing with the dequantized one, `engine quantize` writing Qwen's FP8 layout, the loader
reading it exactly (aligned and unaligned stacks, dense and MoE), quantization at load equal to a
per-channel checkpoint, and broken FP8 checkpoints refused in one line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_checkpoints import checkpoint

from engine_templates.engine.config import EngineConfig, EngineSetupError, ModelConfig, ModelDirError
from engine_templates.engine.cuda_graphs import DecodeGraphs
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.fp8 import FP8, Fp8Linear, Fp8Weight, linear_dequant, linear_rowwise, quantize
from engine_templates.engine.quantize import quantize_checkpoint
from engine_templates.engine.sequence import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox", "Hello world! How are", "Numbers 0 1 2 3 4"]


def quantize_cli(src: Path, dst: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_templates.engine", "quantize", str(src), str(dst), *extra],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> dict[tuple[str, int], Path]:
    """(kind, block) -> the tiny checkpoint quantized by the CLI: per channel (0), 16 x 16 blocks
    (every stacked part a whole number of blocks) and Qwen's 128 x 128 (wider than the tiny model:
    its stacks keep one scale row per weight row)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for kind in ("dense", "moe"):
        for block in (0, 16, 128):
            out[kind, block] = root / f"{kind}-{block}"
            quantize_checkpoint(checkpoint(kind), out[kind, block], block=block, device="cpu", log=lambda _: None)
    return out


def engine(model_dir: Path, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, dtype="fp32", device="cpu", max_model_len=128,
                                  max_num_seqs=4, **settings))


@pytest.mark.parametrize("block", [(1, 200), (16, 16), (128, 128), (32, 48)])
def test_quantization_stays_within_e4m3_rounding(block):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn((70, 200), generator=gen) * torch.logspace(-3, 1, 200)  # columns of very different sizes
    w[:, 96:128] = 0  # whole zero blocks (for the small ones) must not divide by zero
    q = quantize(w, block)
    assert q.q.dtype == FP8 and q.scale.shape == (-(-70 // block[0]), -(-200 // block[1]))
    back = q.dequantize(torch.float32)
    # e4m3 keeps 3 mantissa bits: a value moves by at most 1/16 of itself, or by half the
    # subnormal step (2^-10 of its block's scale) near zero
    from engine_templates.engine.fp8 import expand_scale

    bound = w.abs() / 16 + expand_scale(q.scale, block, w.shape) * 2 ** -10
    assert torch.all((back - w).abs() <= bound * 1.0001)
    assert torch.all(back[:, 96:128] == 0) and torch.isfinite(back).all()
    # each block's largest magnitude is exactly e4m3's largest value
    assert q.q.float().abs().max() == 448


def test_the_scaled_matmul_path_agrees_with_the_dequantized_one():
    # torch._scaled_mm runs row-wise scaling on a CPU too: the layout the GPU path hands it (x per
    # token, the weight's per-channel scales as a row) is checked here, not only on a GPU.
    gen = torch.Generator().manual_seed(1)
    w = quantize(torch.randn((96, 256), generator=gen) * torch.logspace(-1, 1, 96)[:, None], (1, 256))
    x = torch.randn((5, 256), generator=gen).to(torch.bfloat16)
    want = linear_dequant(x.float(), w)
    got = linear_rowwise(x, w).float()
    assert got.shape == want.shape and (got - want).norm() / want.norm() < 0.05
    wrong = Fp8Weight(w.q, w.scale.flip(0), w.block)  # per-channel scales in the wrong rows
    assert (linear_rowwise(x, wrong).float() - want).norm() / want.norm() > 0.3
    # On a CPU the engine dequantizes (the scaled path is a GPU's)
    assert Fp8Linear(torch.device("cpu"), torch.bfloat16).choices == {"channel": "dequant", "block": "dequant"}


def test_quantize_writes_qwens_fp8_layout(fp8_dirs):
    src, dst = checkpoint("moe"), fp8_dirs["moe", 128]
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    assert {f.name for f in src.iterdir()} == {f.name for f in dst.iterdir()}  # tokenizer & co. copied
    before, after = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    quantized = {k for k in before if k.endswith("_proj.weight")}
    assert len(quantized) == 8 * 3 + 3 + 4 * 2  # the experts, layer 1's dense MLP, q/k/v/o in both layers
    for name, t in before.items():
        if name in quantized:
            assert after[name].dtype == FP8 and after[name].shape == t.shape
            assert after[name + "_scale_inv"].dtype == torch.float32
            assert after[name + "_scale_inv"].shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        else:  # embeddings, LM head, norms, the router: as they were
            assert torch.equal(after[name], t), name
    assert set(after) == set(before) | {k + "_scale_inv" for k in quantized}


def test_the_quantize_command(fp8_dirs, tmp_path):
    done = quantize_cli(checkpoint("dense"), tmp_path / "fp8", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"14 matrices to FP8: \S+ MB -> \S+ MB in \S+ s -> {tmp_path / 'fp8'}\n", done.stdout)
    again = quantize_cli(fp8_dirs["dense", 0], tmp_path / "again")
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"infersmith: {fp8_dirs['dense', 0]} is already an FP8 checkpoint (config.json has a quantization_config)"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(EngineSetupError, match=r"full is not empty \(--force writes over its checkpoint\)"):
        quantize_checkpoint(checkpoint("dense"), tmp_path / "full")
    with pytest.raises(EngineSetupError, match="--block must be at least 0"):
        quantize_checkpoint(checkpoint("dense"), tmp_path / "neg", block=-1)
    with pytest.raises(EngineSetupError, match="must go to another directory than its source"):
        quantize_checkpoint(checkpoint("dense"), checkpoint("dense"), force=True)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("block", [0, 16, 128])
def test_the_loader_reads_fp8_checkpoints_exactly(fp8_dirs, kind, block):
    model = engine(fp8_dirs[kind, block]).runner.model
    weights = model.weights()
    stored = load_file(fp8_dirs[kind, block] / "model.safetensors")
    fp8 = ModelConfig.from_dir(fp8_dirs[kind, block]).fp8
    assert fp8.block == (None if block == 0 else (block, block))
    checked = 0
    for name, q in stored.items():
        if q.dtype != FP8:
            continue
        expected = Fp8Weight(q, stored[name + "_scale_inv"], fp8.block_for(q.shape[1])).dequantize(torch.float32)
        expert = name.split("mlp.experts.")
        if len(expert) == 2:  # stacked per layer in the model: [experts, 2 * inter, hidden]
            e, which = int(expert[1].split(".")[0]), expert[1].split(".")[1]
            stack = weights[expert[0] + ("mlp.experts.down_proj" if which == "down_proj" else "mlp.experts.gate_up_proj")]
            got = stack[e].dequantize(torch.float32)
            inter = model.cfg.moe_intermediate
            got = got if which == "down_proj" else got[:inter] if which == "gate_proj" else got[inter:]
        else:
            got = weights[name].dequantize(torch.float32)
        assert torch.equal(got, expected), name
        checked += 1
    assert checked == (35 if kind == "moe" else 14)


def test_quantizing_at_load_equals_the_per_channel_checkpoint(fp8_dirs):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for kind in ("dense", "moe"):
        online = engine(checkpoint(kind), quantization="fp8")
        a, b = online.generate(PROMPTS, params), engine(fp8_dirs[kind, 0]).generate(PROMPTS, params)
        assert [(s.completion_token_ids, s.logprobs) for s in a] == [(s.completion_token_ids, s.logprobs) for s in b]
        moe = {"moe": "dequant (fused_moe is eager, which takes bf16 experts)"} if kind == "moe" else {}
        assert online.kernel_choices["fp8"] == {"block": "channel", "linear": {"channel": "dequant",
                                                                                "block": "dequant"}} | moe
        # the FP8 experts' decode path (gathered experts) under the CUDA-graph bookkeeping, no capture on a CPU
        online.runner.graphs = DecodeGraphs(online.runner, online.model_config, capture=False)
        graphed = online.generate(PROMPTS, params)
        assert [s.completion_token_ids for s in graphed] == [s.completion_token_ids for s in a]
        assert max(abs(x - y) for g, s in zip(graphed, a) for x, y in zip(g.logprobs, s.logprobs)) < 1e-5


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint directory with its tensors passed through edit(dict)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_broken_fp8_checkpoints_are_one_line_errors(fp8_dirs, tmp_path):
    src = fp8_dirs["dense", 16]
    no_scale = _rewrite(src, tmp_path / "no-scale", lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(ModelDirError, match=r"1 FP8 weights lack their other half, e\.g\. "
                                            r"model\.layers\.1\.mlp\.up_proj\.weight_scale_inv"):
        engine(no_scale)
    def squash(t):
        t["model.layers.0.self_attn.o_proj.weight_scale_inv"] = t["model.layers.0.self_attn.o_proj.weight_scale_inv"][:1]
    with pytest.raises(ModelDirError, match=r"o_proj\.weight_scale_inv has shape \(1, 4\), not the \(4, 4\)"):
        engine(_rewrite(src, tmp_path / "bad-shape", squash))
    other = tmp_path / "gptq"
    _rewrite(src, other, lambda t: None)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    r = subprocess.run([sys.executable, "-m", "engine_templates.engine", "generate", "--model-dir", str(other),
                        "--prompt", "hi", "--device", "cpu"], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f'infersmith: {other}/config.json: quantization_config.quant_method "gptq" is not supported (supported: fp8)']


def test_an_fp8_weight_stored_where_the_model_keeps_bf16_is_dequantized(fp8_dirs, tmp_path):
    # Some releases store the MoE router in FP8 too: the model keeps it in its own dtype.
    src = fp8_dirs["moe", 0]
    router = "model.layers.0.mlp.gate.weight"

    def fp8_router(t):
        w = quantize(t[router], (1, t[router].shape[1]))
        t[router], t[router + "_scale_inv"] = w.q, w.scale

    model = engine(_rewrite(src, tmp_path / "fp8-router", fp8_router)).runner.model
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        original = f.get_tensor(router)
    got = model.weights()[router]
    assert got.dtype == torch.float32 and not torch.equal(got, original)
    assert torch.equal(got, quantize(original, (1, original.shape[1])).dequantize(torch.float32))
