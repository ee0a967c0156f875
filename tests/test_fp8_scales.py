"""The FP8 scaled matmuls' scales in the layout torch requires, checked on a CPU (torch has no CPU
kernel for the block-wise path, and a GPU is where a wrong stride used to surface): the rules
written down from torch's own checks, torch's meta functions run on the engine's calls, and
`Fp8Linear._try` falling back on every kind of refusal and naming the path taken."""
from __future__ import annotations

import pytest
import torch

from engine_templates.engine.fp8 import (
    FP8,
    PROBE_K,
    PROBE_TOKENS,
    Fp8Linear,
    Fp8Weight,
    blockwise_scales,
    linear_blockwise,
    linear_dequant,
    linear_rowwise,
    quantize,
    quantize_rows,
    rowwise_scales,
)
from engine_templates.engine.fp8_activations import quantize_groups

# (tokens, K, out): one token and more than 16; K/128 a multiple of 4 and not; out a multiple of
# 128 and not (the last weight block cut short).
SHAPES = [(m, k, n) for m in (1, 2, 40) for k in (128, 512, 768, 4096) for n in (256, 320)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blockwise_rule(m: int, k: int, n: int, a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """torch's rule for scaled_mm(BlockWise1x128, BlockWise128x128), as aten/src/ATen/native/cuda/
    ScaledBlas.cpp `_scaled_block1x128_block128x128` checks it (torch 2.11 and main; the
    `check_size_stride` relaxation there applies only to the 1x128 recipe's dispatch test, not to
    these checks): what is broken, [] when nothing is.
    - scale_a: float32, shape (M, ceil(K/128)), stride(0) == 1 and stride(1) == M (or, with one
      K-block, stride(1) == 1) — column-major, also when M == 1;
    - scale_b: float32, shape (L4, ceil(N/128)) with L4 = ceil(K/128) rounded up to a multiple of 4,
      stride(0) == 1 and stride(1) == L4 (or, with one N-block, stride(1) == 1)."""
    broken, l4 = [], ceil_div(ceil_div(k, 128), 4) * 4
    if a.dtype != torch.float32 or a.shape != (m, ceil_div(k, 128)):
        broken.append(f"scale_a {a.dtype} {tuple(a.shape)}")
    if not (a.stride(0) == 1 and (a.stride(1) == m or (a.shape[1] == 1 and a.stride(1) == 1))):
        broken.append(f"scale_a strides {a.stride()}, not (1, {m})")
    if b.dtype != torch.float32 or b.shape != (l4, ceil_div(n, 128)):
        broken.append(f"scale_b {b.dtype} {tuple(b.shape)}, not ({l4}, {ceil_div(n, 128)})")
    if not (b.stride(0) == 1 and (b.stride(1) == l4 or (b.shape[1] == 1 and b.stride(1) == 1))):
        broken.append(f"scale_b strides {b.stride()}, not (1, {l4})")
    return broken


def rowwise_rule(m: int, n: int, a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """torch's rule for torch._scaled_mm with row-wise scales, as ScaledBlas.cpp's
    `is_rowwise_scaling` (applied to a and to b.t() with scale_b.t()) and `_scaled_rowwise_rowwise`
    check it: scale_a float32 (M, 1) contiguous, scale_b float32 (1, N) contiguous with stride(1) == 1."""
    broken = []
    if a.dtype != torch.float32 or a.shape != (m, 1) or not a.is_contiguous():
        broken.append(f"scale_a {a.dtype} {tuple(a.shape)} strides {a.stride()}")
    if b.dtype != torch.float32 or b.shape != (1, n) or not b.is_contiguous() or b.stride(1) != 1:
        broken.append(f"scale_b {b.dtype} {tuple(b.shape)} strides {b.stride()}")
    if not b.t().is_contiguous():
        broken.append(f"scale_b.t() strides {b.t().stride()}: not contiguous")
    return broken


def weight(n: int, k: int, block: tuple[int, int]) -> Fp8Weight:
    gen = torch.Generator().manual_seed(n * k)
    return quantize(torch.randn((n, k), generator=gen), block)


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("column_major", [True, False])
def test_block_wise_scales_follow_torchs_layout_rule(m, k, n, column_major):
    w = weight(n, k, (128, 128))
    _, sx = quantize_rows(torch.randn((m, k)).to(torch.bfloat16), 128, column_major)
    a, b = blockwise_scales(sx, w)
    assert blockwise_rule(m, k, n, a, b) == []
    assert a is sx or not column_major  # quantized straight into the layout: no copy
    # the values: x's group scales unchanged; the weight's block scales, then zeros in the padding
    assert torch.equal(a, sx)
    assert torch.equal(b[:w.scale.shape[1]], w.scale.t()) and not b[w.scale.shape[1]:].any()


def test_the_old_block_wise_layout_breaks_the_rule_where_the_gpu_refused_it():
    # the layout that a GPU refused for one token: a transposed copy of a (1, 6) scale keeps strides (6, 1)
    w = weight(512, 768, (128, 128))
    _, sx = quantize_rows(torch.randn((1, 768)).to(torch.bfloat16), 128)
    assert blockwise_rule(1, 768, 512, sx.t().contiguous().t(), w.scale.t()) == [
        "scale_a strides (6, 1), not (1, 1)", "scale_b torch.float32 (6, 4), not (8, 4)",
        "scale_b strides (1, 6), not (1, 8)"]


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_row_wise_scales_follow_torchs_layout_rule(m, k, n):
    w = weight(n, k, (1, k))
    _, sx = quantize_rows(torch.randn((m, k)).to(torch.bfloat16))
    a, b = rowwise_scales(sx, w)
    assert rowwise_rule(m, n, a, b) == []
    assert torch.equal(a, sx) and torch.equal(b[0], w.scale[:, 0])


@pytest.mark.parametrize("m, k, n", [s for s in SHAPES if s[2] % 128 == 0])
def test_torchs_meta_functions_take_the_engines_calls(m, k, n):
    """torch's meta functions for _scaled_mm_v2 and _scaled_mm (torch/_meta_registrations.py) check
    the same shapes and strides: the engine's own calls, on meta tensors, pass them. (Only for whole
    128-row blocks of the weight: the meta function counts them as floor(N/128) where the CUDA check
    rounds up.)"""
    x = torch.empty((m, k), dtype=torch.bfloat16, device="meta")
    block = Fp8Weight.empty((n, k), (128, 128), "meta")
    assert linear_blockwise(x, block).shape == (m, n)
    channel = Fp8Weight.empty((n, k), (1, k), "meta")
    assert linear_rowwise(x, channel).shape == (m, n)


def test_the_probe_covers_one_token_many_tokens_and_both_kinds_of_k():
    assert 1 in PROBE_TOKENS and max(PROBE_TOKENS) > 16
    assert {k // 128 % 4 == 0 for k in PROBE_K} == {True, False}


def raises(error: Exception):
    def linear_refusing(x, w):
        raise error
    return linear_refusing


def imports_a_missing_name(x, w):
    from torch.nn.functional import ScalingTypeOfAnotherTorch  # noqa: F401  # an older or newer torch
    return linear_dequant(x, w)


def passes_bad_arguments(x, w):
    return torch.nn.functional.scaled_mm(x, w.q.t())  # a signature of another torch


@pytest.mark.parametrize("path, why", [
    (raises(ValueError("scale_a must have strides (1, 1); got [1, 6]")),
     "linear_refusing refused at 1 x 512: ValueError: scale_a must have strides (1, 1); got [1, 6]"),
    (raises(RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore lines")),
     "linear_refusing refused at 1 x 512: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"),
    (raises(NotImplementedError("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90")),
     "linear_refusing refused at 1 x 512: NotImplementedError: DeepSeek style (1x128, 128x128) scaling only "
     "supported in CUDA for SM90"),
    (imports_a_missing_name, "imports_a_missing_name refused at 1 x 512: ImportError: cannot import name "
                             "'ScalingTypeOfAnotherTorch' from 'torch.nn.functional'"),
    (passes_bad_arguments, "passes_bad_arguments refused at 1 x 512: TypeError: "),
])
def test_every_refusal_falls_back_to_dequantizing_and_says_why(path, why):
    linear = Fp8Linear(torch.device("cpu"), torch.bfloat16)
    linear._try("block", path, torch.device("cpu"), (128, 128))
    assert linear.paths["block"] is linear_dequant
    assert linear.choices["block"].startswith(f"dequant ({why}"), linear.choices["block"]
    assert linear.choices["channel"] == "dequant"


def test_a_path_that_runs_and_agrees_is_taken_and_named():
    # torch._scaled_mm has a CPU kernel for row-wise scales: the real path, probed at every shape
    linear = Fp8Linear(torch.device("cpu"), torch.bfloat16)
    linear._try("channel", linear_rowwise, torch.device("cpu"), None)
    assert linear.paths["channel"] is linear_rowwise and linear.choices["channel"] == "rowwise"
    # the block-wise path has no CPU kernel: a real refusal from torch
    linear._try("block", linear_blockwise, torch.device("cpu"), (128, 128))
    assert linear.choices["block"].startswith("dequant (linear_blockwise refused at 1 x 512: "), linear.choices


def test_a_path_that_disagrees_is_refused():
    def linear_doubled(x, w):
        return 2 * linear_dequant(x, w)

    linear = Fp8Linear(torch.device("cpu"), torch.bfloat16)
    linear._try("block", linear_doubled, torch.device("cpu"), (128, 128))
    assert linear.paths["block"] is linear_dequant
    assert linear.choices["block"].startswith("dequant (linear_doubled disagreed at 1 x 512: relative error 1")


@pytest.mark.parametrize("tokens, cols, group, column_major", [
    (1, 512, 128, True), (5, 768, 128, True), (40, 4096, 128, True), (5, 768, 768, False), (1, 4096, 4096, False)])
def test_the_gpu_kernels_scales_are_torchs_in_the_layout_asked(tokens, cols, group, column_major):
    """The one-kernel quantization a GPU runs (here in Triton's interpreter): the scales of torch's
    ops, in the strides asked for. (The interpreter converts to e4m3 otherwise than a GPU does: the
    values are compared bit for bit on a GPU, in tests/test_gpu_engine.py.)"""
    x = torch.randn((tokens, cols), generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    q, scale = quantize_groups(x, group, column_major)
    _, want = quantize_rows(x, group)
    assert q.dtype == FP8 and q.shape == x.shape and torch.equal(scale, want)
    groups = cols // group
    assert scale.stride() == ((1, tokens) if column_major else (groups, 1))
