"""The vision ops (layernorm, gelu, vision_attention, vision_linear): each oracle against a hand computation or
transformers' own SAM 3 code, the eager baseline, template points through the harness's own check
(Triton's interpreter on a CPU), shapes from the vision presets, and the roofline counts."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Before any Triton kernel is defined: on a CPU, kernels run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from contract.job import Shape  # noqa: E402
from engine_templates.ops import get_op  # noqa: E402
from engine_templates.ops.base import DISTRIBUTIONS, generator  # noqa: E402
from engine_templates.ops.vision_attention import rotary_table  # noqa: E402
from engine_templates.vision import SAM3_PRESETS, sam3_hf_config  # noqa: E402
from harness.checks import check_call, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
TINY, REAL = SAM3_PRESETS["sam3-tiny"], SAM3_PRESETS["sam3"]
LN, GELU, ATTN, VLIN = get_op("layernorm"), get_op("gelu"), get_op("vision_attention"), get_op("vision_linear")


def draw(op, shape, dtype=torch.bfloat16, seed=0, dist="normal"):
    return op.inputs(shape, dtype, DEVICE, generator(DEVICE, seed), dist)


def far(template):
    return {k: v[-1] for k, v in template.space.items()}


def test_registered_as_vision_ops():
    assert {op.name for op in (LN, GELU, ATTN, VLIN)} == {"layernorm", "gelu", "vision_attention", "vision_linear"}
    assert all(op.modality == "vision" for op in (LN, GELU, ATTN, VLIN)) and get_op("rmsnorm").modality == "text"
    assert ATTN.arg_names == ["q", "k", "v", "cos", "sin", "scale"] and ATTN.persistent == ("cos", "sin")
    assert LN.persistent == ("weight", "bias")


def test_shapes_come_from_the_presets_dims_and_images_per_batch():
    # sam3: 1008 / 14 = a 72 x 72 grid, 9 windows of 24 x 24; 16 heads of 64; MLP 4,736 wide
    assert [(s.label, s.dims) for s in LN.shapes(REAL, [1, 8])] == [
        ("images_1", {"tokens": 5184, "hidden": 1024}), ("images_8", {"tokens": 8 * 5184, "hidden": 1024})]
    assert [s.dims for s in GELU.shapes(REAL, [2])] == [{"tokens": 2 * 5184, "inter": 4736}]
    assert [(s.label, s.dims["seqs"], s.dims["side"]) for s in ATTN.shapes(REAL, [1, 8])] == [
        ("window_i1", 9, 24), ("window_i8", 72, 24), ("global_i1", 1, 72), ("global_i8", 8, 72)]
    assert {(s.dims["heads"], s.dims["head_dim"], s.dims["window"]) for s in ATTN.shapes(REAL, [1])} == {(16, 64, 24)}
    # sam3-tiny: a 10 x 10 grid, windows of 4 x 4 over the grid padded to 12 x 12: 9 a side
    assert [(s.label, s.dims["seqs"], s.dims["side"]) for s in ATTN.shapes(TINY, [2])] == [
        ("window_i2", 18, 4), ("global_i2", 2, 10)]
    assert LN.shapes(TINY, [3])[0].dims == {"tokens": 300, "hidden": 48}
    assert [(s.label, s.dims) for s in VLIN.shapes(REAL, [1])] == [
        ("qkv_images_1", {"tokens": 5184, "in": 1024, "out": 3072}), ("o_images_1", {"tokens": 5184, "in": 1024, "out": 1024}),
        ("fc1_images_1", {"tokens": 5184, "in": 1024, "out": 4736}), ("fc2_images_1", {"tokens": 5184, "in": 4736, "out": 1024})]


def test_layernorm_reference_matches_a_hand_computation():
    x, weight, bias, eps = draw(LN, Shape("s", {"tokens": 2, "hidden": 12}), dist="offset")
    y = LN.reference(x, weight, bias, eps)
    for t in range(2):
        row = [float(v) for v in x[t]]
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        for j, v in enumerate(row):
            want = (v - mean) / math.sqrt(var + eps) * float(weight[j]) + float(bias[j])
            assert math.isclose(y[t, j].item(), want, rel_tol=1e-9, abs_tol=1e-12)


def test_gelu_is_the_exact_one_transformers_sam3_uses():
    from transformers.activations import ACT2FN

    assert sam3_hf_config("sam3").vision_config.backbone_config.hidden_act == "gelu"
    (x,) = draw(GELU, Shape("s", {"tokens": 4, "inter": 64}), torch.float32, dist="uniform")
    ref = GELU.reference(x)
    assert rel_error(ACT2FN["gelu"](x.double()), ref) < 1e-15
    for v, want in zip(x.flatten()[:8].tolist(), ref.flatten()[:8].tolist()):
        assert math.isclose(want, v * 0.5 * (1 + math.erf(v / math.sqrt(2))), rel_tol=1e-12, abs_tol=1e-300)
    # the tanh approximation is another function: 1e-4 apart, far above float32's rounding
    assert rel_error(torch.nn.functional.gelu(x, approximate="tanh"), ref) > 1e-5


@pytest.mark.parametrize("window", [True, False], ids=["windowed", "global"])
def test_attention_reference_is_what_transformers_computes(window):
    """transformers' own SAM 3 ViT layer, in float64: its rotary table and its attention module
    (projections, 2D rotation, attention) against the op's table and reference between the same
    projections."""
    from transformers.models.sam3.modeling_sam3 import Sam3ViTLayer

    cfg = sam3_hf_config("sam3-tiny").vision_config.backbone_config
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = Sam3ViTLayer(cfg, window_size=cfg.window_size if window else 0).double().eval()
    side = cfg.window_size if window else TINY.grid
    cos, sin = layer.rotary_emb(torch.zeros(1), layer.position_ids)
    my_cos, my_sin = rotary_table(side, TINY.window_size, TINY.head_dim, TINY.rope_theta)
    assert torch.allclose(cos.float()[0], my_cos, atol=1e-6) and torch.allclose(sin.float()[0], my_sin, atol=1e-6)
    attn = layer.attention
    h = torch.randn(3, side, side, TINY.hidden, dtype=torch.float64)
    want = attn(h, (cos.double(), sin.double()))[0]
    shape = (3, side * side, TINY.heads, TINY.head_dim)
    q, k, v = (proj(h).reshape(shape) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    got = attn.o_proj(ATTN.reference(q, k, v, cos[0].double(), sin[0].double(), attn.scaling).flatten(2))
    # transformers turns q and k in float32 whatever their dtype (apply_rotary_pos_emb_2d): ~1e-8
    assert rel_error(got.reshape(want.shape), want) < 1e-6


def check_shapes(op):
    return op.shapes(TINY, [1, 2]) + op.odd_shapes(TINY)


@pytest.mark.parametrize("op", [LN, GELU, ATTN, VLIN], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_matches_reference(op, dtype):
    for i, shape in enumerate(check_shapes(op)):
        args = draw(op, shape, dtype, i, DISTRIBUTIONS[i % len(DISTRIBUTIONS)])
        assert rel_error(op.eager(*args), op.reference(*args)) < RTOL[dtype], shape.label


CASES = [(op, point) for op in (LN, GELU, ATTN, VLIN) for t in op.templates.values() for point in (t.default, far(t))]
CASES += [(LN, {"block_n": 256, "rows_per_program": 2, "num_warps": 2, "num_stages": 1}),  # chunked rows
          (ATTN, {"block_m": 16, "block_n": 32, "num_warps": 2, "num_stages": 1})]  # several key tiles


@pytest.mark.parametrize("op, point", CASES, ids=[f"{op.name}-{','.join(map(str, p.values()))}" for op, p in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_template_point_passes_the_harness_check(op, point, dtype):
    fn = next(iter(op.templates.values())).build(point)
    shapes = check_shapes(op) + ([Shape("real_width_3rows", {"tokens": 3, "hidden": REAL.hidden})]
                                 if op is LN else [])
    for i, shape in enumerate(shapes):
        dist = DISTRIBUTIONS[i % len(DISTRIBUTIONS)]
        result = check_call(op, fn, draw(op, shape, dtype, i, dist), dtype, DEVICE, RTOL[dtype])
        assert result.ok, f"{shape.label} ({dist}): {result.gate} {result.detail}"


def test_the_oracle_tells_the_ops_from_their_near_misses():
    """A LayerNorm without the mean, SiLU for GELU, attention without the turn or with the
    language models' half rotation: each far outside the tolerance (the gauntlet's cheats)."""
    x, w, b, eps = draw(LN, LN.shapes(TINY, [1])[0], dist="offset")
    h = x.float()
    no_mean = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float() + b.float()).to(x.dtype)
    assert not check_call(LN, lambda *a: no_mean, (x, w, b, eps), x.dtype, DEVICE, 1e-2).ok
    (g,) = draw(GELU, GELU.shapes(TINY, [1])[0])
    assert not check_call(GELU, torch.nn.functional.silu, (g,), g.dtype, DEVICE, 1e-2).ok
    args = draw(ATTN, ATTN.shapes(TINY, [1])[1])
    q, k, v, cos, sin, scale = args
    plain = lambda *a: ATTN.eager(q, k, v, torch.ones_like(cos), torch.zeros_like(sin), scale)  # noqa: E731
    assert not check_call(ATTN, plain, args, q.dtype, DEVICE, 1e-2).ok
    half = torch.cat((cos[:, 0::2], cos[:, 1::2]), -1), torch.cat((sin[:, 0::2], sin[:, 1::2]), -1)
    assert rel_error(ATTN.reference(q, k, v, *half, scale), ATTN.reference(*args)) > 0.1
    x, w, b = draw(VLIN, VLIN.shapes(TINY, [1])[0])
    assert not check_call(VLIN, lambda *a: torch.nn.functional.linear(x, w), (x, w, b), x.dtype, DEVICE, 1e-2).ok


def test_bytes_and_flops():
    s = Shape("s", {"tokens": 2, "hidden": 8})
    assert LN.bytes(s, torch.bfloat16) == (32 + 16) * 2 and LN.flops(s) == 7 * 16  # x, y; weight, bias
    g = Shape("s", {"tokens": 2, "inter": 8})
    assert GELU.bytes(g, torch.float32) == 2 * 16 * 4 and GELU.flops(g) == 5 * 16
    a = ATTN.shapes(REAL, [1])[1]  # global: 5,184 tokens
    t = 5184
    assert ATTN.bytes(a, torch.bfloat16) == 4 * t * 1024 * 2 + 2 * t * 64 * 4
    assert ATTN.flops(a) == 16 * 64 * (4 * t * t + 6 * t)
    lin = Shape("s", {"tokens": 2, "in": 8, "out": 4})
    assert VLIN.bytes(lin, torch.bfloat16) == (16 + 32 + 4 + 8) * 2 and VLIN.flops(lin) == 2 * 2 * 8 * 4 + 8


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_transformers_own_bf16_attention_is_within_the_tolerance_at_sam3s_windows(dist):
    """At the real model's shape, what transformers computes in bf16 (the eager baseline: q and k
    turned in float32, rounded to bf16, then SDPA) stays well inside bf16's tolerance for every
    input draw: an honest kernel is not failed by the inputs. The heavy draw's q and k are scaled to
    a unit mean square for this (unscaled, a global layer's 5,184 tokens land past 1e-2)."""
    args = draw(ATTN, ATTN._shape("sam3_2windows", REAL, 2, REAL.window_size), dist=dist)
    assert rel_error(ATTN.eager(*args), ATTN.reference(*args)) < 0.6e-2
    if dist == "heavy":
        assert 0.5 < args[0].float().pow(2).mean().item() < 2.0
