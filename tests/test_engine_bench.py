"""`engine bench` end to end on the tiny presets (CPU, float32), and what it stands on: random
weights of a preset's shape, transformers' model sharing them, the weight-bytes counts, and the
decode-graph bookkeeping (static buffers, padding rows, width buckets) run without capture."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from counted_kernels import calls, counting_kernels  # noqa: E402

from cli.main import main  # noqa: E402
from engine_templates.engine.bench.roofline import weight_bytes  # noqa: E402
from engine_templates.engine.config import EngineConfig, KernelSpec, ModelConfig  # noqa: E402
from engine_templates.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.loader import random_weights  # noqa: E402
from engine_templates.engine.sequence import SamplingParams  # noqa: E402
from engine_templates.models import PRESETS, Llama3Rope  # noqa: E402

# Few programs per launch: Triton's interpreter on a CPU takes time per program.
SPLIT_KV = KernelSpec("template", "split_kv", {"num_splits": 2, "block_n": 16, "num_warps": 1, "num_stages": 1})


def test_bench_on_tiny_presets_writes_every_figure_and_agrees_with_transformers(tmp_path, capsys):
    out = tmp_path / "bench"
    # not eager: a float64 reference, and rmsnorm by a kernel that counts its calls (eager's work)
    kernels = tmp_path / "mine.json"
    counted = tmp_path / "counted"
    kernels.write_text(json.dumps({**counting_kernels(counted, ["rmsnorm"]), "fused_moe": {"impl": "reference"}}))
    code = main(["engine", "bench", "--out", str(out), "--presets", "tiny", "tiny-moe", "--dtype", "fp32",
                 "--device", "cpu", "--kernels", "eager", "--kernels", str(kernels),
                 "--decode-tokens", "6", "--hf-decode-tokens", "3", "--ttft-lengths", "20", "40",
                 "--ttft-reps", "2", "--concurrency", "3", "--concurrent-prompt", "9",
                 "--concurrent-tokens", "4", "--hf-concurrent-tokens", "3", "--check-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 0, err
    result = json.loads((out / "engine_bench.json").read_text())
    assert result["ceilings"]["copy_bytes_per_s"] > 0
    metrics = ["decode_b1_tok_s", "ttft_20_ms", "ttft_40_ms", "concurrent_3_tok_s"]
    table = (out / "engine_bench.md").read_text()
    for preset in ("tiny", "tiny-moe"):
        r = result["presets"][preset]
        assert set(r["systems"]) == {"engine", "engine+mine.json", "hf"}
        for name, system in r["systems"].items():
            assert "error" not in system, (preset, name, system)
            for m in metrics:
                value = system["metrics"][m]["value"]
                assert math.isfinite(value) and value > 0, (preset, name, m)
                assert 0 < r["roofline"][m] < math.inf
        for name in ("engine", "engine+mine.json"):
            check = r["systems"][name]["check"]
            assert check["agree"] and check["engine_vs_hf"]["agree"], (preset, name, check)
            assert check["engine_vs_hf"]["max_logprob_diff"] < 1e-3
            assert check["engine_vs_hf"]["hf_greedy_equal_prefix"] == [4, 4, 4]
        assert r["systems"]["engine+mine.json"]["kernels"]["rmsnorm"] == {"impl": "free",
                                                                          "path": str(counted / "rmsnorm.py")}
        assert r["systems"]["engine+mine.json"]["kernels"]["fused_moe"] == {"impl": "reference"}
        # The concurrent phase made every token it was asked for, and counted them.
        assert r["systems"]["engine"]["metrics"]["concurrent_3_tok_s"]["tokens"] == 3 * 4
        section = table.split(f"## {preset}\n")[1].split("\n## ")[0]
        for row in ("decode, batch 1 (tok/s)", "TTFT, 20 tokens (ms)", "TTFT, 40 tokens (ms)",
                    "output, 3 concurrent (tok/s)"):
            assert f"| {row} |" in section
        assert section.count("%)") == 3 * 4  # every system's four figures with their fractions
        assert "| engine | ok |" in section and "| engine+mine.json | ok |" in section
    # the engine+mine.json runs called the kernel their file names: one rmsnorm per forward
    # (a figure's steps and the check's, both presets), the plain engine's none
    assert calls(counted, "rmsnorm") > 2 * (6 + 4), calls(counted, "rmsnorm")


def test_a_bad_bench_option_is_one_line(capsys, tmp_path):
    code = main(["engine", "bench", "--out", str(tmp_path), "--presets", "qwen3-9000b"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'qwen3-9000b' is neither a model preset" in err


@pytest.mark.parametrize("preset, total_params, moe_params_per_layer", [
    ("qwen3-8b", 8_190_735_360, 0),  # Qwen/Qwen3-8B, as transformers counts it
    ("qwen3-30b-a3b", 30_532_122_624, 128 * 3 * 768 * 2048),  # Qwen/Qwen3-30B-A3B
    ("llama-3.1-8b", 8_030_261_248, 0),  # meta-llama/Llama-3.1-8B
    ("mistral-7b-v0.3", 7_248_023_552, 0),  # mistralai/Mistral-7B-v0.3
    ("qwen2.5-7b", 7_615_616_512, 0),  # Qwen/Qwen2.5-7B (q/k/v biases included)
    ("mixtral-8x7b", 46_702_792_704, 8 * 3 * 14336 * 4096),  # mistralai/Mixtral-8x7B-v0.1
])
def test_weight_bytes_of_one_decode_token_are_the_model_less_embeddings_and_idle_experts(
        preset, total_params, moe_params_per_layer):
    cfg = ModelConfig.from_preset(PRESETS[preset])
    idle_experts = cfg.layers * moe_params_per_layer * (1 - cfg.experts_per_token / cfg.experts) if cfg.is_moe else 0
    expected = total_params - cfg.vocab * cfg.hidden + cfg.hidden - idle_experts
    assert weight_bytes(cfg, 1, 2) == pytest.approx(2 * expected, rel=1e-12)
    if cfg.is_moe:  # 32 tokens route to most of the experts
        assert weight_bytes(cfg, 1, 2) < weight_bytes(cfg, 32, 2) < 2 * total_params


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "qwen3-8b", "qwen3-30b-a3b", "llama-3.1-8b",
                                    "mistral-7b-v0.3", "qwen2.5-7b", "mixtral-8x7b"])
def test_transformers_config_describes_the_same_model(preset):
    from engine_templates.engine.oracle import hf_config

    cfg = ModelConfig.from_preset(PRESETS[preset])
    assert ModelConfig._parse(hf_config(cfg, "sdpa").to_dict(), Path("/nonexistent")) == cfg


TINY_ARCHITECTURES = {  # the tiny presets' shapes as the other architectures
    "qwen3_moe": PRESETS["tiny-moe"],
    "llama": dataclasses.replace(PRESETS["tiny"], arch="llama", rope_scaling=Llama3Rope(8.0, 1.0, 4.0, 64)),
    "qwen2": dataclasses.replace(PRESETS["tiny"], arch="qwen2", qkv_bias=True),
    "mixtral": dataclasses.replace(PRESETS["tiny-moe"], arch="mixtral"),
}


@pytest.mark.parametrize("arch", list(TINY_ARCHITECTURES))
def test_transformers_model_shares_the_engine_weights_and_computes_the_same_logits(arch):
    from engine_templates.engine.oracle import HFOracle

    cfg = ModelConfig.from_preset(TINY_ARCHITECTURES[arch])
    weights = random_weights(cfg, torch.float32, "cpu", seed=3)
    oracle = HFOracle.sharing(cfg, weights)
    assert oracle.model.config.model_type == arch
    hf = dict(oracle.model.named_parameters())
    shared = ["model.embed_tokens.weight", "lm_head.weight"] + (["model.layers.1.mlp.experts.gate_up_proj"]
                                                                  if cfg.is_moe else [])
    for name in shared:
        assert hf[name].data_ptr() == weights[name].data_ptr()
    assert not any(w.requires_grad for w in weights.values())
    norms = [w for n, w in weights.items() if n.endswith("norm.weight")]
    assert norms and all(bool((w == 1).all()) for w in norms)
    assert abs(float(weights["lm_head.weight"].std()) - 0.02) < 0.002
    engine = LLMEngine(EngineConfig(dtype="fp32", device="cpu", max_num_seqs=2, max_model_len=64), cfg, weights)
    prompt = [5, 77, 301, 9, 12]
    seq = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert oracle.greedy(prompt, 5) == seq.completion_token_ids
    assert max(abs(a - b) for a, b in zip(oracle.logprobs(prompt, seq.completion_token_ids), seq.logprobs)) < 1e-4


def test_an_engine_without_a_tokenizer_takes_only_token_ids():
    cfg = ModelConfig.from_preset(PRESETS["tiny"])
    engine = LLMEngine(EngineConfig(dtype="fp32", device="cpu", max_num_seqs=2, max_model_len=64), cfg,
                       random_weights(cfg, torch.float32, "cpu"))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("text", SamplingParams())
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request([1, 2], SamplingParams(stop=("x",)))


@pytest.mark.parametrize("preset, kernels", [("tiny", {}), ("tiny-moe", {}),
                                             ("tiny", {"decode_attention": SPLIT_KV})])
def test_decode_graph_buffers_padding_and_width_buckets_give_the_eager_answers(preset, kernels):
    """DecodeGraphs without capture runs each decode step on its static buffers, padded to the
    batch size and block-table width it would replay: the answers must be the plain path's.
    On a GPU host it runs there: Triton kernels (split_kv) run in the interpreter only on a
    host without CUDA, and cannot take CPU tensors where CUDA is."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig.from_preset(PRESETS[preset])
    weights = random_weights(cfg, torch.float32, device, seed=1)
    # num_kv_blocks as a CPU would size it (8 sequences x 32 blocks): two engines in one process,
    # where gpu_memory_utilization would give the first the GPU and the second nothing
    config = EngineConfig(dtype="fp32", device=device, block_size=4, max_num_seqs=8, max_model_len=128,
                          num_kv_blocks=256, kernels=kernels)
    plain, padded = LLMEngine(config, cfg, weights), LLMEngine(config, cfg, weights)
    graphs = padded.runner.graphs = DecodeGraphs(padded.runner, cfg, capture=False)
    assert graphs.sizes == ([1, 2, 4] if cfg.is_moe else [1, 2, 4, 8]) and graphs.widths == [8, 16, 32]
    # Three sequences (a batch of 4 with a padding row); the longest table grows past 8 blocks.
    prompts = [[3, 1, 4, 1, 5], list(range(10, 40)), [7] * 17]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = plain.generate(prompts, params)
    got = padded.generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.completion_token_ids == e.completion_token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-5
    # The last step ran through the buffers: three real rows, then a padding row of length 1.
    assert graphs.seq_lens[:4].tolist() == [s.num_tokens - 1 for s in got] + [1]
    assert graphs.block_table[3, :16].tolist() == [padded.runner.scratch_block] * 16


def test_the_bench_imports_nothing_a_gpu_host_lacks(tmp_path):
    """The GPU hosts have torch, triton, transformers, aiohttp and numpy, not the controller's
    packages: `python -m engine_templates.engine bench` must not import them."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from engine_templates.engine.cli import main\n"
        f"rc = main(['bench', '--out', {str(tmp_path)!r}, '--presets', 'tiny', '--dtype', 'fp32',\n"
        "            '--device', 'cpu', '--decode-tokens', '2', '--hf-decode-tokens', '2',\n"
        "            '--ttft-lengths', '8', '--ttft-reps', '1', '--concurrency', '2', '--concurrent-prompt', '4',\n"
        "            '--concurrent-tokens', '2', '--hf-concurrent-tokens', '2', '--check-tokens', '2'])\n"
        "controller = {'prefect', 'mlflow', 'pydantic', 'optuna', 'flows', 'tasks', 'tracking', 'gpu_pool', 'proposers'}\n"
        "print(rc, sorted(controller & {m.split('.')[0] for m in sys.modules}))\n")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "0 []", done.stdout + done.stderr


def test_the_shipped_templates_kernels_file_names_a_template_for_every_op():
    from engine_templates.engine.kernels import ENGINE_OPS, KernelSet, parse_kernels_file

    path = Path(__file__).resolve().parent.parent / "engine_templates" / "engine" / "bench" / "templates.json"
    choices = KernelSet(parse_kernels_file(path)).choices
    assert set(choices) == set(ENGINE_OPS) and all(c["impl"] == "template" for c in choices.values())


def test_long_context_decode_counts_the_kv_cache_and_fp8_halves_the_matrices():
    from engine_templates.engine.bench.roofline import bounds, kv_bytes

    cfg = ModelConfig.from_preset(PRESETS["qwen3-8b"])
    assert kv_bytes(cfg, 32768, 2) == 2 * 36 * 8 * 128 * 32768 * 2  # K and V, every layer, bf16
    b = bounds(cfg, 2, 4.8e12, 1e15, [2048], 32, decode_context=160, concurrent_context=192,
               long_contexts=(32768,), decode_tokens=128)
    weights = weight_bytes(cfg, 1, 2)
    assert b["decode_b1_ctx32768_tok_s"] == pytest.approx(4.8e12 / (weights + kv_bytes(cfg, 32768 + 64, 2)))
    assert b["decode_b1_ctx32768_tok_s"] < 0.8 * b["decode_b1_tok_s"]  # the cache is a third of the weights there
    assert b["decode_b1_tok_s"] == pytest.approx(4.8e12 / (weights + kv_bytes(cfg, 160, 2)))
    # FP8: the layers' matrices at one byte, embeddings, LM head and norms as they were
    fp8 = weight_bytes(cfg, 1, 2, matrix_itemsize=1)
    norms = 36 * (2 * cfg.hidden + 2 * cfg.head_dim) + cfg.hidden
    assert fp8 == pytest.approx(weights - (8_190_735_360 - 2 * cfg.vocab * cfg.hidden - norms), rel=1e-12)


def test_a_sliding_window_bounds_the_kv_cache_read_and_the_attention_flops():
    from engine_templates.engine.bench.roofline import kv_bytes, prefill_flops

    windowed, full = ModelConfig.from_preset(PRESETS["mistral-7b-v0.1"]), ModelConfig.from_preset(PRESETS["mistral-7b-v0.3"])
    full = dataclasses.replace(full, vocab=windowed.vocab)  # v0.3's larger vocabulary aside, the same model
    assert kv_bytes(windowed, 32768, 2) == kv_bytes(full, 4096, 2) == 2 * 32 * 8 * 128 * 4096 * 2
    assert kv_bytes(windowed, 1000, 2) == kv_bytes(full, 1000, 2)
    assert prefill_flops(windowed, 4096) == prefill_flops(full, 4096)
    # past the window each token sees 4096 keys: 4 flops per key, channel and head, per layer
    extra = prefill_flops(windowed, 4097) - prefill_flops(windowed, 4096)
    assert extra - (prefill_flops(full, 4097) - prefill_flops(full, 4096)) == pytest.approx(-4 * 32 * 128 * 32)


def test_bench_fp8_speculative_and_long_context_variants(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["engine", "bench", "--out", str(out), "--presets", "tiny", "--dtype", "fp32", "--device", "cpu",
                 "--fp8", "--spec-tokens", "3", "--decode-contexts", "100",
                 "--decode-tokens", "6", "--hf-decode-tokens", "3", "--ttft-lengths", "20", "--ttft-reps", "1",
                 "--concurrency", "2", "--concurrent-prompt", "9", "--concurrent-tokens", "4",
                 "--hf-concurrent-tokens", "3", "--check-tokens", "4"])
    assert code == 0, capsys.readouterr().err
    r = json.loads((out / "engine_bench.json").read_text())["presets"]["tiny"]
    systems = r["systems"]
    assert list(systems) == ["engine", "hf", "engine+spec3", "engine+fp8", "engine+fp8+spec3"]
    for name in ("engine", "engine+spec3", "engine+fp8", "engine+fp8+spec3"):
        assert systems[name]["check"]["agree"], (name, systems[name]["check"])
        assert systems[name]["metrics"]["decode_b1_ctx100_tok_s"]["value"] > 0
    assert "decode_b1_ctx100_tok_s" not in systems["hf"]["metrics"]
    assert systems["engine+fp8"]["fp8"]["block"] == "channel"
    assert systems["engine+fp8"]["roofline"]["decode_b1_tok_s"] > 1.5 * r["roofline"]["decode_b1_tok_s"]
    # Prompt lookup drafts from a sequence's own repeats, which random prompts of a 512-token
    # vocabulary have: some steps verified drafts, 1 to 3 each, and no more were accepted than drafted.
    spec = systems["engine+spec3"]["speculative"]
    assert 0 < spec["verify_steps"] <= spec["drafted_tokens"] <= 3 * spec["verify_steps"], spec
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["drafted_tokens"]
    assert "speculative" not in systems["engine"]
    table = (out / "engine_bench.md").read_text()
    assert "| decode, batch 1, after 100 tokens (tok/s) |" in table and "of its FP8 roofline)" in table
    assert "| engine+fp8+spec3 | " in table.split("acceptance rate |")[1]


def test_bench_runs_each_pattern_of_a_serving_file_in_process(tmp_path, capsys):
    serving = tmp_path / "serving.yaml"
    serving.write_text(
        "traffic:\n"
        "  - {name: pair, concurrency: 2, input_tokens_mean: 12, input_tokens_stddev: 3, output_tokens_mean: 5,"
        " request_count: 5, warmup_requests: 1}\n"
        "  - {name: paced, concurrency: null, request_rate: 200, input_tokens_mean: 8, output_tokens_mean: 3,"
        " request_count: 4, warmup_requests: 0}\n"
        "accuracy: {held_out: 1}\n")
    out = tmp_path / "bench"
    code = main(["engine", "bench", "--out", str(out), "--presets", "tiny", "--dtype", "fp32", "--device", "cpu",
                 "--skip-hf", "--serving", str(serving), "--decode-tokens", "4", "--ttft-lengths", "20",
                 "--ttft-reps", "1", "--concurrency", "2", "--concurrent-prompt", "9", "--concurrent-tokens", "4",
                 "--check-tokens", "4"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / "engine_bench.json").read_text())
    assert [p["name"] for p in result["serving"]] == ["pair", "paced"]
    got = result["presets"]["tiny"]["systems"]["engine"]["serving"]
    assert (got["pair"]["requests"], got["pair"]["output_tokens"]) == (5, 25)  # the warm-up not counted
    assert (got["paced"]["requests"], got["paced"]["output_tokens"]) == (4, 12)
    ordered = lambda low, high: 0 < low <= high * (1 + 1e-12)  # percentiles, to the rounding of interpolation
    for figures in got.values():
        assert ordered(figures["ttft_p50_ms"], figures["ttft_p90_ms"])
        assert ordered(figures["itl_p50_ms"], figures["itl_p90_ms"])
        assert ordered(figures["output_tps_per_user_p10"], figures["output_tps_per_user_p50"])
        assert figures["output_tps"] == pytest.approx(figures["output_tokens"] / figures["span_s"])
    table = (out / "engine_bench.md").read_text()
    assert "| pair | output_tps | " in table and "| paced | itl_p90_ms | " in table


@pytest.mark.parametrize("text, says", [
    ("traffic:\n  - {name: a, concurrency: 1, burst: 3}\n", "unknown fields ['burst']"),
    ("accuracy: {held_out: 1}\n", "no `traffic:` list"),
    ("traffic:\n  - {name: a, concurrency: 2, request_rate: 3}\n", "concurrency or request_rate, one"),
])
def test_a_bad_serving_file_is_one_line(tmp_path, capsys, text, says):
    serving = tmp_path / "serving.yaml"
    serving.write_text(text)
    code = main(["engine", "bench", "--out", str(tmp_path / "o"), "--presets", "tiny", "--device", "cpu",
                 "--serving", str(serving)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
