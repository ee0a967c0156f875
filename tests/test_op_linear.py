"""linear and the fp8 op targets: the oracle against a hand computation, the baselines, template
points through the harness's own check (Triton's interpreter on a CPU), the shapes and roofline
counts; the fp8 targets' quantization, their oracle (the bf16 weights) and tolerance, planted
scale errors; and `infersmith evaluate` of the bf16 and fp8 targets end to end."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Before any Triton kernel is defined: on a CPU, kernels run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import CANDIDATES  # noqa: E402

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: E402, F401

from contract.job import Shape  # noqa: E402
from engine_templates.models import PRESETS  # noqa: E402
from engine_templates.ops import FP8_OPS, get_op  # noqa: E402
from engine_templates.ops.base import DISTRIBUTIONS, generator  # noqa: E402
from engine_templates.ops.fp8 import BLOCK, FP8, dequantize, expand_scale, quantize_blocks  # noqa: E402
from engine_templates.ops.linear import OP  # noqa: E402
from engine_templates.ops.linear.templates import _round_e4m3  # noqa: E402
from harness.checks import check_call, rel_error  # noqa: E402
from targets import DEFAULT_RTOL  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
FP8_RTOL = DEFAULT_RTOL["fp8"]
TEMPLATE = OP.templates["tiles"]
FP8_OP = get_op("linear", "fp8")
FP8_TEMPLATE = FP8_OP.templates["tiles"]
MOE_FP8 = get_op("fused_moe", "fp8")
FAR = {k: v[-1] for k, v in TEMPLATE.space.items()}


def check_shapes(op=OP) -> list[Shape]:
    tiny = PRESETS["tiny"]
    # tiny's every class, its odd sizes (several 128 x 128 blocks each way) and a 3-block-wide weight
    return (op.shapes(tiny, [1, 3], [37], []) + op.odd_shapes(tiny)
            + [Shape("wide", {"tokens": 5, "in": 300, "out": 270})])


def draw(op, shape, dtype=torch.bfloat16, seed=0, dist="normal"):
    return op.inputs(shape, dtype, DEVICE, generator(DEVICE, seed), dist)


def test_registered_with_an_fp8_target():
    assert get_op("linear") is OP and OP.arg_names == ["x", "weight"] and OP.persistent == ("weight",)
    assert sorted(FP8_OPS) == ["fused_moe", "linear"]
    assert FP8_OP.signature == "linear(x, weight, weight_scale)" and FP8_OP.oracle is OP
    assert FP8_OP.persistent == ("weight", "weight_scale")
    assert MOE_FP8.arg_names == ["x", "router_logits", "w_gate_up", "w_gate_up_scale", "w_down", "w_down_scale",
                                 "top_k", "renormalize"]
    assert MOE_FP8.oracle is get_op("fused_moe") and get_op("rmsnorm").oracle is get_op("rmsnorm")
    with pytest.raises(KeyError, match="rmsnorm has no fp8 target; ops with one: fused_moe, linear"):
        get_op("rmsnorm", "fp8")


def test_reference_matches_a_hand_computation():
    x, weight = draw(OP, Shape("s", {"tokens": 2, "in": 5, "out": 3}))
    ref = OP.reference(x, weight)
    for t in range(2):
        for o in range(3):
            assert ref[t, o].item() == pytest.approx(sum(float(x[t, i]) * float(weight[o, i]) for i in range(5)),
                                                     rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_matches_reference(dtype):
    for i, shape in enumerate(check_shapes()):
        args = draw(OP, shape, dtype, i, DISTRIBUTIONS[i % len(DISTRIBUTIONS)])
        assert rel_error(OP.eager(*args), OP.reference(*args)) < RTOL[dtype], shape.label


@pytest.mark.parametrize("point", [TEMPLATE.default, FAR, {**TEMPLATE.default, "block_m": 32, "group_m": 1}],
                         ids=["default", "far", "m32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_template_point_passes_the_harness_check(point, dtype):
    fn = TEMPLATE.build(point)
    for i, shape in enumerate(check_shapes()):
        dist = DISTRIBUTIONS[i % len(DISTRIBUTIONS)]
        result = check_call(OP, fn, draw(OP, shape, dtype, i, dist), dtype, DEVICE, RTOL[dtype])
        assert result.ok, f"{shape.label} ({dist}): {result.gate} {result.detail}"


def test_shapes_are_the_presets_projections():
    shapes = {s.label: s.dims for s in OP.shapes(PRESETS["qwen3-8b"], [1], [2048], [4096])}
    assert shapes == {
        "qkv_decode_b1": {"tokens": 1, "in": 4096, "out": 6144}, "qkv_prefill_2048": {"tokens": 2048, "in": 4096, "out": 6144},
        "o_decode_b1": {"tokens": 1, "in": 4096, "out": 4096}, "o_prefill_2048": {"tokens": 2048, "in": 4096, "out": 4096},
        "gate_up_decode_b1": {"tokens": 1, "in": 4096, "out": 24576},
        "gate_up_prefill_2048": {"tokens": 2048, "in": 4096, "out": 24576},
        "down_decode_b1": {"tokens": 1, "in": 12288, "out": 4096},
        "down_prefill_2048": {"tokens": 2048, "in": 12288, "out": 4096}}
    # a mixture-of-experts preset's MLP is fused_moe: attention projections only
    moe = {s.label for s in OP.shapes(PRESETS["qwen3-30b-a3b"], [8], [], [])}
    assert moe == {"qkv_decode_b8", "o_decode_b8"}


def test_bytes_and_flops():
    shape = Shape("s", {"tokens": 2, "in": 256, "out": 130})
    # read x (512) and the weight (33,280), write y (260) elements
    assert OP.bytes(shape, torch.bfloat16) == 2 * (512 + 33280 + 260)
    assert OP.flops(shape) == 2 * 2 * 256 * 130
    # fp8: the weight at one byte, its 2 x 2 float32 scales, activations and output in bf16
    assert FP8_OP.bytes(shape, torch.bfloat16) == 2 * (512 + 260) + 33280 + 4 * 4
    assert FP8_OP.flops(shape) == OP.flops(shape)


# -- the fp8 target ------------------------------------------------------------------------

def test_block_quantization_round_trip():
    w = torch.randn(300, 270) * torch.logspace(-2, 2, 270)  # columns of very different sizes
    q, scale = quantize_blocks(w)
    assert q.dtype == FP8 and scale.shape == (3, 3) and scale.dtype == torch.float32
    # every block's largest magnitude maps to 448; e4m3 keeps 3 mantissa bits: within 1/16 of
    # each value, or half the subnormal step (2^-9 of the scale) below 2^-6 of it
    assert q.float().abs().amax().item() == 448
    back = dequantize(q, scale, torch.float32)
    bound = torch.maximum(w.abs() / 16, expand_scale(scale, BLOCK, w.shape) * 2.0 ** -10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()


def test_fp8_inputs_are_the_bf16_draw_quantized():
    # The candidate's weight and the oracle's come from one draw: the oracle sees the weight the
    # candidate's e4m3 values were made from.
    shape = Shape("s", {"tokens": 3, "in": 200, "out": 150})
    x8, q, scale = draw(FP8_OP, shape, seed=5, dist="heavy")
    x, w = draw(OP, shape, seed=5, dist="heavy")
    assert torch.equal(x8, x) and q.dtype == FP8 and scale.shape == (2, 2)
    assert torch.equal(q, quantize_blocks(w)[0])


def _fp8_worst(op, fn, shapes, seeds=1) -> float:
    """fn's worst relative error against the bf16 oracle, over every distribution; each call also
    through the harness's own check at the fp8 tolerance."""
    worst = 0.0
    for seed in range(seeds):
        for shape in shapes:
            for dist in DISTRIBUTIONS:
                args, oracle_args = draw(op, shape, seed=seed, dist=dist), draw(op.oracle, shape, seed=seed, dist=dist)
                result = check_call(op, fn, args, torch.bfloat16, DEVICE, FP8_RTOL, oracle_args=oracle_args)
                assert result.ok, f"{shape.label} ({dist}): {result.gate} {result.detail}"
                worst = max(worst, result.rel_error)
    return worst


def test_fp8_eager_is_within_the_tolerance_and_far_from_it():
    # The documented default is set well above what e4m3 itself costs (targets.DEFAULT_RTOL).
    worst = _fp8_worst(FP8_OP, FP8_OP.eager, check_shapes(FP8_OP), seeds=2)
    assert 0.01 < worst < FP8_RTOL / 3


@pytest.mark.parametrize("point", [FP8_TEMPLATE.default, {k: v[-1] for k, v in FP8_TEMPLATE.space.items()},
                                   {**FP8_TEMPLATE.default, "block_k": 32, "block_n": 128}],
                         ids=["default", "far-fp8-dot", "k32"])
def test_fp8_template_applies_block_scales_in_the_kernel(point):
    fn = FP8_TEMPLATE.build(point)
    shapes = check_shapes(FP8_OP)
    assert _fp8_worst(FP8_OP, fn, shapes) < FP8_RTOL / 2
    # against the dequantized weight itself: only the kernel's own rounding (bf16 output; with
    # fp8_dot the activations' e4m3 too)
    for i, shape in enumerate(shapes):
        args = draw(FP8_OP, shape, seed=i, dist="uniform")
        assert rel_error(fn(*args), FP8_OP.reference(*args)) < (0.06 if point["fp8_dot"] else 0.01), shape.label


@triton.jit
def _round(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, _round_e4m3(tl.load(X + i)))


def test_interpreter_rounds_to_e4m3_as_torch_does():
    # fp8_dot's activations under the interpreter, whose own cast to e4m3 rounds 31.4 to 16
    x = torch.cat([torch.randn(3072) * 60, torch.randn(1024) * 0.01]).clamp(-448, 448).to(DEVICE)
    y = torch.empty_like(x)
    _round[(1,)](x, y, N=x.numel())
    assert torch.equal(y, x.to(FP8).float())


@pytest.mark.parametrize("plant", ["divisor", "block_doubled", "transposed"])
def test_planted_scale_errors_fail_the_accuracy_gate(plant):
    def wrong(x, weight, weight_scale):
        if plant == "divisor":  # weight = q / scale, as `scale_inv` suggests
            return (x.float() @ (weight.float() / expand_scale(weight_scale, BLOCK, weight.shape)).t()).to(x.dtype)
        s = weight_scale.clone()
        if plant == "block_doubled":
            s[0, 0] *= 2
        else:  # the table read as [in blocks, out blocks] (3 x 3 here)
            s = s.t().contiguous()
        return FP8_OP.eager(x, weight, s)

    shape = Shape("wide", {"tokens": 5, "in": 300, "out": 270})
    failed = []
    for seed, dist in enumerate(DISTRIBUTIONS):
        args, oracle_args = draw(FP8_OP, shape, seed=seed, dist=dist), draw(OP, shape, seed=seed, dist=dist)
        result = check_call(FP8_OP, wrong, args, torch.bfloat16, DEVICE, FP8_RTOL, oracle_args=oracle_args)
        failed.append(not result.ok and result.gate == "accuracy")
    assert all(failed) if plant != "block_doubled" else any(failed)


def test_fused_moe_fp8_eager_and_template():
    tiny = PRESETS["tiny-moe"]
    shapes = MOE_FP8.shapes(tiny, [1, 4], [9], []) + MOE_FP8.odd_shapes(tiny)
    assert _fp8_worst(MOE_FP8, MOE_FP8.eager, shapes) < FP8_RTOL
    template = MOE_FP8.templates["gemv"]
    for point in (template.default, {k: v[-1] for k, v in template.space.items()}):
        fn = template.build(point)
        for i, shape in enumerate(shapes):
            args = draw(MOE_FP8, shape, seed=i, dist=DISTRIBUTIONS[i % 4])
            # the kernel against the dequantized experts: float32 sums, a bf16 output
            assert rel_error(fn(*args), MOE_FP8.reference(*args)) < 0.01, shape.label


def test_fused_moe_fp8_bytes_count_the_experts_at_one_byte():
    shape = Shape("s", {"tokens": 1, "hidden": 256, "inter": 128, "experts": 8, "top_k": 2})
    experts = 2 * (3 * 128 * 256 + 4 * (2 * 2 + 2 * 1))  # two routed experts and their scales
    assert MOE_FP8.bytes(shape, torch.bfloat16) == experts + 2 * (2 * 256 + 8)


# -- the command ---------------------------------------------------------------------------

def _evaluate(capsys, op, model, candidate, *extra):
    from cli.main import main

    code = main(["evaluate", "--op", op, "--model", model, "--candidate", str(candidate), "--seeds", "1", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("op, model, candidate, dtype", [
    ("linear", "tiny", "linear/honest_torch.py", "bf16"),
    ("linear", "tiny", "linear/fp8_honest_dequant.py", "fp8"),
    ("fused_moe", "tiny-moe", "fused_moe/fp8_honest_dequant.py", "fp8"),
])
def test_evaluate_passes_the_honest_candidate(capsys, prefect_server, tracking_home, op, model, candidate, dtype):
    code, out, err = _evaluate(capsys, op, model, CANDIDATES / candidate, "--dtype", dtype)
    assert code == 0, out + err
    assert "status: pass" in out and "ok   correctness" in out
    if dtype == "fp8":
        assert f"<= {FP8_RTOL:g}" in out  # judged at the fp8 tolerance


def test_evaluate_fails_a_planted_scale_error_at_the_accuracy_gate(capsys, prefect_server, tracking_home):
    code, out, _ = _evaluate(capsys, "linear", "tiny", CANDIDATES / "linear/fp8_scale_as_divisor.py", "--dtype", "fp8")
    assert code == 1 and "status: fail" in out and "FAIL accuracy" in out


@pytest.mark.parametrize("argv", [
    ["evaluate", "--op", "rmsnorm", "--model", "tiny", "--dtype", "fp8", "--candidate",
     str(CANDIDATES / "rmsnorm/honest_torch.py")],
    ["optimize", "--op", "rmsnorm", "--model", "tiny", "--dtype", "fp8"],
])
def test_an_op_without_an_fp8_target_is_a_usage_error(capsys, argv):
    from cli.main import main

    code = main(argv)
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "rmsnorm has no fp8 target; ops with one: fused_moe, linear" in err


def test_an_fp8_candidate_with_the_bf16_signature_is_refused(capsys):
    code, _, err = _evaluate(capsys, "linear", "tiny", CANDIDATES / "linear/honest_torch.py", "--dtype", "fp8")
    assert code == 2 and "does not match the op's signature `linear(x, weight, weight_scale)`" in err
