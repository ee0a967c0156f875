"""fused_add_rmsnorm: the oracle against a hand computation, the eager baseline, template points
through the harness's own check (Triton's interpreter on a CPU), and the roofline counts."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Before any Triton kernel is defined: on a CPU, kernels run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from contract.job import Shape  # noqa: E402
from engine_templates.models import PRESETS  # noqa: E402
from engine_templates.ops import get_op  # noqa: E402
from engine_templates.ops.base import DISTRIBUTIONS, generator  # noqa: E402
from engine_templates.ops.fused_add_rmsnorm import OP  # noqa: E402
from harness.checks import check_call, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
TEMPLATE = OP.templates["rows"]
POINTS = [
    TEMPLATE.default,
    {"block_n": 256, "rows_per_program": 2, "num_warps": 2, "num_stages": 1},  # chunked rows
    {"block_n": 1024, "rows_per_program": 4, "num_warps": 8, "num_stages": 3},
    {"block_n": 0, "rows_per_program": 4, "num_warps": 1, "num_stages": 2},  # rows past the end
]


def check_shapes() -> list[Shape]:
    tiny = PRESETS["tiny"]
    # tiny's rows fit one block; the qwen3 widths make block_n 256 and 1024 run in chunks.
    return (OP.shapes(tiny, [1, 3], [5], [37, 64]) + OP.odd_shapes(tiny)
            + [Shape("qwen3-8b_3rows", {"tokens": 3, "hidden": PRESETS["qwen3-8b"].hidden}),
               Shape("qwen3-30b_odd", {"tokens": 5, "hidden": PRESETS["qwen3-30b-a3b"].hidden + 13})])


def draw(shape, dtype, seed=0, dist="normal"):
    return OP.inputs(shape, dtype, DEVICE, generator(DEVICE, seed), dist)


def test_registered():
    assert get_op("fused_add_rmsnorm") is OP
    assert OP.n_outputs == 2 and OP.arg_names == ["x", "residual", "weight", "eps"]


def test_reference_matches_a_hand_computation():
    x, residual, weight, eps = draw(Shape("s", {"tokens": 3, "hidden": 24}), torch.bfloat16)
    normed, new_residual = OP.reference(x, residual, weight, eps)
    for t in range(3):
        # The stored residual: the float32 sum rounded to bf16, as torch's own bf16 add does.
        r = [float(v) for v in (x[t].float() + residual[t].float()).to(torch.bfloat16)]
        rstd = 1.0 / math.sqrt(sum(v * v for v in r) / len(r) + eps)
        for j, v in enumerate(r):
            assert new_residual[t, j].item() == v
            assert math.isclose(normed[t, j].item(), v * rstd * float(weight[j]), rel_tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_matches_reference(dtype):
    for i, shape in enumerate(check_shapes()):
        args = draw(shape, dtype, i, DISTRIBUTIONS[i % len(DISTRIBUTIONS)])
        normed, new_residual = OP.eager(*args)
        ref_normed, ref_residual = OP.reference(*args)
        assert rel_error(normed, ref_normed) < RTOL[dtype], shape.label
        # x + residual in the op dtype is the correctly rounded sum: exactly the reference's.
        assert torch.equal(new_residual.double(), ref_residual.to(new_residual.device)), shape.label


@pytest.mark.parametrize("point", POINTS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_template_point_passes_the_harness_check(point, dtype):
    fn = TEMPLATE.build(point)
    for i, shape in enumerate(check_shapes()):
        dist = DISTRIBUTIONS[i % len(DISTRIBUTIONS)]
        args = draw(shape, dtype, i, dist)
        result = check_call(OP, fn, args, dtype, DEVICE, RTOL[dtype])  # also: inputs unchanged
        assert result.ok, f"{shape.label} ({dist}): {result.gate} {result.detail}"
        if dtype == torch.float32:  # the float32 sum is stored as is: bit-exact
            assert torch.equal(fn(*args)[1], args[0] + args[1]), shape.label


def test_returns_new_tensors_and_leaves_inputs_alone():
    args = draw(OP.odd_shapes(PRESETS["tiny"])[1], torch.bfloat16, 7, "heavy")
    before = [a.clone() for a in args[:3]]
    normed, new_residual = TEMPLATE.build(TEMPLATE.default)(*args)
    for a, b in zip(args[:3], before):
        assert torch.equal(a, b)
    ptrs = {a.untyped_storage().data_ptr() for a in args[:3]}
    assert normed.untyped_storage().data_ptr() not in ptrs
    assert new_residual.untyped_storage().data_ptr() not in ptrs


def test_check_rejects_a_kernel_that_forgets_the_residual():
    # The oracle must tell a plain RMSNorm of x from the fused op, else the tests above prove little.
    def wrong(x, residual, weight, eps):
        normed, _ = OP.eager(x, torch.zeros_like(residual), weight, eps)
        return normed, x + residual

    args = draw(Shape("s", {"tokens": 4, "hidden": 96}), torch.bfloat16)
    result = check_call(OP, wrong, args, torch.bfloat16, DEVICE, 1e-2)
    assert not result.ok and result.gate == "accuracy"


def test_shapes_follow_the_workload():
    shapes = OP.shapes(PRESETS["qwen3-8b"], [1, 32], [2048], [4096])
    assert [(s.label, s.dims) for s in shapes] == [
        ("decode_b1", {"tokens": 1, "hidden": 4096}), ("decode_b32", {"tokens": 32, "hidden": 4096}),
        ("prefill_2048", {"tokens": 2048, "hidden": 4096})]


def test_bytes_and_flops():
    shape = Shape("s", {"tokens": 2, "hidden": 8})
    # read x (16) + residual (16) + weight (8), write normed (16) + residual (16): 72 elements
    assert OP.bytes(shape, torch.bfloat16) == 144
    assert OP.bytes(shape, torch.float32) == 288
    assert OP.flops(shape) == 80


def test_automatic_warps_follow_the_row_width():
    # num_warps=0, the rows template's default: 16 elements of the power-of-two row a thread,
    # 4 to 16 warps (8 for qwen3-8b, 4 for qwen3-30b-a3b: the H200's fastest at decode).
    from engine_templates.ops.rmsnorm.templates import auto_warps
    assert TEMPLATE.default["num_warps"] == 0 and 0 in TEMPLATE.space["num_warps"]
    widths = {96: 4, 2048: 4, PRESETS["qwen3-8b"].hidden: 8, 5120: 16, 16384: 16}
    assert {w: auto_warps(w) for w in widths} == widths
