"""`engine bench --profile` on the tiny MoE preset (CPU, float32): a prefill step at each TTFT
length and a batch-1 decode step, time per op category and the launch gaps, in the JSON and the
markdown; and the categories a GPU's kernel names fall in."""
from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cli.main import main  # noqa: E402
from engine_templates.engine.bench.op_profile import CATEGORIES, by_name, category, ranges  # noqa: E402
from engine_templates.engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.loader import random_weights  # noqa: E402
from engine_templates.models import PRESETS  # noqa: E402


def test_bench_profile_writes_each_steps_categories_and_launch_gaps(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["engine", "bench", "--out", str(out), "--presets", "tiny-moe", "--dtype", "fp32", "--device", "cpu",
                 "--skip-hf", "--profile", "--moe-prefill", "triton", "--decode-tokens", "6", "--ttft-lengths", "20", "70",
                 "--ttft-reps", "1",
                 "--concurrency", "2", "--concurrent-prompt", "9", "--concurrent-tokens", "4", "--check-tokens", "4"])
    assert code == 0, capsys.readouterr().err
    system = json.loads((out / "engine_bench.json").read_text())["presets"]["tiny-moe"]["systems"]["engine"]
    # --moe-prefill reached the engine: the 70-token prompts' MoE calls ran the Triton grouped GEMMs
    assert system["kernels"]["moe_prefill"]["path"] == "triton grouped"
    assert system["kernels"]["moe_prefill"]["calls"]["triton"] >= 2, system["kernels"]["moe_prefill"]
    prof = system["profile"]
    assert list(prof) == ["prefill_20", "prefill_70", "decode_b1"]
    assert prof["prefill_70"]["tokens"] == 70 and prof["decode_b1"]["context"] == 32
    for step, p in prof.items():
        cats = p["categories_us"]
        assert list(cats) == list(CATEGORIES) and p["device"] == "cpu"
        assert sum(cats.values()) == pytest.approx(p["busy_us"])
        assert p["gap_us"] == pytest.approx(p["wall_us"] - p["busy_us"]) and 0 < p["busy_us"] < p["wall_us"]
        # every part of a MoE model's step shows: the linear layers, attention, the norms, q/k norm
        # and rope, the experts' GEMMs and their routing
        for cat in ("gemm", "attention", "norm", "rope", "moe_gemm", "moe_routing"):
            assert cats[cat] > 0, (step, cat, cats)
        assert p["top"] and all(t["category"] in CATEGORIES for t in p["top"])
    table = (out / "engine_bench.md").read_text()
    assert "| category | prefill_20 | prefill_70 | decode_b1 |" in table
    for row in ("| moe_gemm |", "| launch gaps (wall − kernels) |", "| step wall time |"):
        assert row in table


def test_without_profile_the_bench_has_no_profile(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["engine", "bench", "--out", str(out), "--presets", "tiny", "--dtype", "fp32", "--device", "cpu",
                 "--skip-hf", "--decode-tokens", "3", "--ttft-lengths", "20", "--ttft-reps", "1", "--concurrency", "2",
                 "--concurrent-prompt", "9", "--concurrent-tokens", "2", "--check-tokens", "2"])
    assert code == 0, capsys.readouterr().err
    system = json.loads((out / "engine_bench.json").read_text())["presets"]["tiny"]["systems"]["engine"]
    assert "profile" not in system and "Profile of" not in (out / "engine_bench.md").read_text()


@pytest.mark.parametrize("name, expected", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("_flash_prefill", "attention"), ("_split_kv_partial", "attention"), ("_split_kv_combine", "attention"),
    ("_qk_norm_rope_tile", "rope"), ("_rope_rows", "rope"),
    ("_fused_add_rmsnorm_rows", "norm"), ("_rmsnorm_rows", "norm"),
    ("_gate_up_grouped", "moe_gemm"), ("_down_grouped", "moe_gemm"), ("_gate_up_act", "moe_gemm"),
    ("_down", "moe_gemm"), ("_route", "moe_routing"), ("_sum_slots", "moe_routing"),
    ("_silu_mul_flat", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::index_elementwise_kernel<128, 4>", "elementwise"),
    ("aten::mm", "gemm"), ("aten::_grouped_mm", "moe_gemm"), ("aten::mul", "elementwise"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "other"),
])
def test_kernel_names_fall_in_their_category(name, expected):
    assert by_name(name) == expected


def test_an_engine_op_decides_its_kernels_category():
    # inside an op its category wins over the kernel's name; in the MoE block GEMMs are moe_gemm
    assert category("void at::native::vectorized_elementwise_kernel<4>", "rmsnorm") == "norm"
    assert category("aten::mul", "qk_norm_rope") == "rope"
    assert category("nvjet_tst_192x192", "fused_moe") == "moe_gemm"
    assert category("aten::bmm", "fused_moe") == "moe_gemm"
    assert category("void at::native::sbtopk::gatherTopK<float>", "fused_moe") == "moe_routing"
    assert category("void at::native::vectorized_elementwise_kernel<4>", None) == "elementwise"


def test_ranges_wrap_the_ops_for_the_block_and_restore_them():
    cfg = ModelConfig.from_preset(PRESETS["tiny-moe"])
    eng = LLMEngine(EngineConfig(model_dir=None, dtype="fp32", device="cpu", max_model_len=32, max_num_seqs=1),
                    cfg, random_weights(cfg, torch.float32, "cpu"))
    before = eng.kernels.rmsnorm
    with ranges(eng):
        assert eng.kernels.rmsnorm is not before and "_moe" in vars(eng.runner.model)
    assert eng.kernels.rmsnorm is before and "_moe" not in vars(eng.runner.model)


def test_chunk_choice_is_the_smallest_within_the_margin_of_the_best():
    from engine_templates.engine.bench.chunk import choose

    points = [{"tokens": 128, "efficiency": 0.30}, {"tokens": 512, "efficiency": 0.62},
              {"tokens": 1024, "efficiency": 0.71}, {"tokens": 2048, "efficiency": 0.76},
              {"tokens": 4096, "efficiency": 0.74}]
    assert choose(points, 0.9) == 1024  # 0.71 >= 0.9 * 0.76; 512's 0.62 is not
    assert choose(points, 1.0) == 2048
    assert choose(points, 0.5) == 512
    assert choose(points[:1], 0.9) == 128


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_chunk_sweep_times_a_layers_gemms_and_counts_their_flops(preset):
    from engine_templates.engine.bench.chunk import layer_flops, layer_gemms, sweep

    cfg = ModelConfig.from_preset(PRESETS[preset])
    out = layer_gemms(cfg, 40, torch.float32, "cpu")()
    assert out.shape == (40, cfg.hidden)
    h, hd = cfg.hidden, cfg.head_dim
    mlp = (cfg.experts * h + cfg.experts_per_token * 3 * cfg.moe_intermediate * h if cfg.is_moe
           else 3 * cfg.intermediate * h)
    assert layer_flops(cfg, 40) == 2 * 40 * ((cfg.heads + 2 * cfg.kv_heads) * hd * h + h * cfg.heads * hd + mlp)
    # a timer that takes a fixed 2 µs a token: every point at the same efficiency, given the rate
    points = sweep(cfg, torch.float32, "cpu", 1e9, tokens=(16, 64), timer=lambda fn, device: 2.0 * fn().shape[0])
    assert [p["tokens"] for p in points] == [16, 64] and [p["us"] for p in points] == [32.0, 128.0]
    assert points[0]["efficiency"] == pytest.approx(layer_flops(cfg, 16) / 32e-6 / 1e9)
    assert points[0]["efficiency"] == pytest.approx(points[1]["efficiency"])


def test_bench_chunk_sweep_sets_each_variants_prefill_chunk(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["engine", "bench", "--out", str(out), "--presets", "tiny", "--dtype", "fp32", "--device", "cpu",
                 "--skip-hf", "--chunk-sweep", "--profile", "--decode-tokens", "3", "--ttft-lengths", "300",
                 "--ttft-reps", "1", "--concurrency", "2", "--concurrent-prompt", "9", "--concurrent-tokens", "2",
                 "--check-tokens", "2"])
    assert code == 0, capsys.readouterr().err
    r = json.loads((out / "engine_bench.json").read_text())["presets"]["tiny"]
    sweep = r["chunk_sweep"]
    assert [p["tokens"] for p in sweep["points"]] == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert all(p["us"] > 0 and p["efficiency"] > 0 for p in sweep["points"])
    best = max(p["efficiency"] for p in sweep["points"])
    assert sweep["chosen"] == min(p["tokens"] for p in sweep["points"] if p["efficiency"] >= sweep["within"] * best)
    system = r["systems"]["engine"]
    assert system["config"]["max_num_batched_tokens"] == sweep["chosen"]
    assert system["profile"]["prefill_300"]["steps"] == -(-300 // sweep["chosen"])
    assert f"Prefill chunk {sweep['chosen']} tokens" in (out / "engine_bench.md").read_text()
