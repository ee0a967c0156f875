"""decode_attention_swa and prefill_attention_swa: the window as transformers' Mistral masks it
(its masking_utils, key j seen from position p iff p - window < j <= p), the oracles against each
other and the full-attention ops, eager and the shared templates' windowed kernels through the
harness's own check (Triton's interpreter on a CPU), a kernel that ignores the window rejected,
the shapes a model's window gives, and the roofline counts."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Before any Triton kernel is defined: on a CPU, kernels run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from contract.job import Shape  # noqa: E402
from engine_templates.models import PRESETS  # noqa: E402
from engine_templates.ops import get_op  # noqa: E402
from engine_templates.ops.base import DISTRIBUTIONS, generator  # noqa: E402
from harness.checks import check_call, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
DECODE, PREFILL = get_op("decode_attention_swa"), get_op("prefill_attention_swa")
TINY = PRESETS["tiny-swa"]
POINTS = {  # a non-default point each: small tiles, many splits (empty ones past the window)
    "decode_attention_swa": {"num_splits": 8, "block_n": 16, "num_warps": 2, "num_stages": 1},
    # query blocks longer than key tiles: a later row's window starts past a program's first tiles
    "prefill_attention_swa": {"block_m": 64, "block_n": 16, "num_warps": 4, "num_stages": 1},
}


def shapes(op, model=TINY):
    return op.shapes(model, [1, 3], [20, 40], [24, 48]) + op.odd_shapes(model)


def draw(op, shape, dtype, i=0):
    return op.inputs(shape, dtype, DEVICE, generator(DEVICE, i), DISTRIBUTIONS[i % len(DISTRIBUTIONS)])


def test_registered_beside_the_full_attention_ops_with_their_templates():
    for op, full in ((DECODE, "decode_attention"), (PREFILL, "prefill_attention")):
        assert op.arg_names == get_op(full).arg_names + ["window"]
        assert op.templates == get_op(full).templates and op.persistent == ()


def test_shapes_carry_the_models_window_and_a_model_without_one_is_refused():
    assert {s.dims["window"] for s in DECODE.shapes(TINY, [1], [], [48])} == {19}
    assert {s.dims["window"] for s in PREFILL.shapes(PRESETS["mistral-7b-v0.1"], [], [2048], [32768])} == {4096}
    assert all(s.dims["window"] < s.dims.get("context", 0) + s.dims.get("q_len", 0) + s.dims.get("prefix", 0)
               for op in (DECODE, PREFILL) for s in op.odd_shapes(PRESETS["mistral-7b-v0.1"]))
    for op in (DECODE, PREFILL):
        with pytest.raises(ValueError, match=f"{op.name} needs a model with a sliding_window; tiny has none"):
            op.shapes(PRESETS["tiny"], [1], [40], [48])


def test_an_op_on_a_model_without_a_window_is_one_line_and_exit_2(capsys):
    from cli.main import main

    assert main(["optimize", "--op", "prefill_attention_swa", "--model", "tiny", "--budget", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "prefill_attention_swa on tiny: prefill_attention_swa needs a model with a sliding_window" in err


def hf_mask(n_q: int, prefix: int, total: int, window: int) -> torch.Tensor:
    """transformers' own sliding-window causal mask for queries at positions prefix.. over keys 0..total-1."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(window)
    q_idx, kv_idx = prefix + torch.arange(n_q)[:, None], torch.arange(total)[None, :]
    return fn(torch.tensor(0), torch.tensor(0), q_idx, kv_idx).expand(n_q, total)


def test_prefill_reference_is_attention_under_transformers_sliding_window_mask():
    shape = PREFILL.odd_shapes(TINY)[1]  # 3 sequences, a chunk after a prefix, window 19
    q, k_cache, v_cache, cu, seq_lens, table, scale, window = draw(PREFILL, shape, torch.float32, 1)
    out = PREFILL.reference(q, k_cache, v_cache, cu, seq_lens, table, scale, window)
    group = q.shape[1] // k_cache.shape[2]
    for b, total in enumerate(seq_lens.tolist()):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        n = rows.stop - rows.start
        pos = torch.arange(total)
        k = k_cache[table[b, pos // k_cache.shape[1]].long(), pos % k_cache.shape[1]].double()
        v = v_cache[table[b, pos // v_cache.shape[1]].long(), pos % v_cache.shape[1]].double()
        s = torch.einsum("qhd,khd->hqk", q[rows].double(), k.repeat_interleave(group, 1)) * scale
        s = s.masked_fill(~hf_mask(n, total - n, total, window), float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(group, 1))
        assert torch.allclose(out[rows], expected, rtol=1e-9, atol=1e-9), b
        assert hf_mask(n, total - n, total, window).sum(1).max() == window  # the window bites here


def test_each_prefill_row_is_decode_at_its_length_and_the_window_changes_the_answer():
    """Row p of prefill is the decode query of a sequence of p + 1 positions, window and all."""
    shape = PREFILL.odd_shapes(TINY)[0]
    q, k_cache, v_cache, cu, seq_lens, table, scale, window = draw(PREFILL, shape, torch.float32, 2)
    out = PREFILL.reference(q, k_cache, v_cache, cu, seq_lens, table, scale, window)
    rows = torch.arange(int(cu[1]))  # sequence 0, a fresh prompt: row i is position i
    decode = DECODE.reference(q[rows], k_cache, v_cache, (rows + 1).int(), table[[0]].expand(len(rows), -1),
                              scale, window)
    assert torch.allclose(out[rows], decode, rtol=1e-9, atol=1e-9)
    full = get_op("prefill_attention").reference(q, k_cache, v_cache, cu, seq_lens, table, scale)
    assert torch.allclose(out[:window], full[:window], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out[window:int(cu[1])], full[window:int(cu[1])])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", [DECODE, PREFILL], ids=lambda o: o.name)
def test_eager_matches_reference(op, dtype):
    for i, shape in enumerate(shapes(op)):
        args = draw(op, shape, dtype, i)
        out = op.eager(*args)
        assert out.dtype == dtype and out.shape == args[0].shape
        assert rel_error(out, op.reference(*args)) < RTOL[dtype], shape.label


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("point", ["default", "point"])
@pytest.mark.parametrize("op", [DECODE, PREFILL], ids=lambda o: o.name)
def test_template_point_passes_the_harness_check(op, point, dtype):
    template = next(iter(op.templates.values()))
    fn = template.build(template.default if point == "default" else POINTS[op.name])
    for i, shape in enumerate(shapes(op)):
        result = check_call(op, fn, draw(op, shape, dtype, i), dtype, DEVICE, RTOL[dtype])
        assert result.ok, f"{shape.label}: {result.gate} {result.detail}"


@pytest.mark.parametrize("op", [DECODE, PREFILL], ids=lambda o: o.name)
def test_check_rejects_attention_to_every_key(op):
    """The full-attention op's template and eager, the window dropped: off on every windowed shape."""
    full = get_op(op.name.removesuffix("_swa"))
    template = next(iter(full.templates.values())).build(next(iter(full.templates.values())).default)
    for fn in (template, full.eager):
        for i, shape in enumerate(op.shapes(TINY, [3], [40], [48])):
            result = check_call(op, lambda *args, _fn=fn: _fn(*args[:-1]), draw(op, shape, torch.float32, i),
                                torch.float32, DEVICE, RTOL[torch.float32])
            assert not result.ok and result.gate == "accuracy", shape.label


def test_a_window_the_context_fits_in_is_full_attention():
    wide = dataclasses.replace(TINY, sliding_window=4096)
    for op in (DECODE, PREFILL):
        full = get_op(op.name.removesuffix("_swa"))
        for i, shape in enumerate(op.shapes(wide, [3], [40], [48])):
            args = draw(op, shape, torch.float32, i)
            assert torch.equal(op.reference(*args), full.reference(*args[:-1])), shape.label
            assert op.bytes(shape, torch.bfloat16) == full.bytes(shape, torch.bfloat16)
            assert op.flops(shape) == full.flops(shape)


def test_bytes_and_flops():
    # decode: lengths 5 and 3 (decode_attention's seq_lens_for(2, 5)), window 4: 4 + 3 positions
    shape = Shape("s", {"batch": 2, "context": 5, "q_heads": 4, "kv_heads": 2, "head_dim": 16,
                        "paged": 1, "block_size": 4, "window": 4})
    # K and V: 7 x 2 x 16 x 2 bytes, twice = 896; q and out 512; seq_lens 8; blocks of positions
    # 1..4 (2) and 0..2 (1): 12
    assert DECODE.bytes(shape, torch.bfloat16) == 896 + 512 + 8 + 12
    assert DECODE.flops(shape) == 4 * 7 * 4 * 16
    # prefill: one sequence of 3 new tokens after 5, window 4: keys 2..7 read (6); pairs 4 + 4 + 4
    shape = Shape("s", {"batch": 1, "q_len": 3, "prefix": 5, "q_heads": 4, "kv_heads": 2, "head_dim": 16,
                        "block_size": 16, "window": 4})
    assert PREFILL.bytes(shape, torch.bfloat16) == (6 * 2 * 16 * 2 + 2 * 3 * 4 * 16) * 2
    assert PREFILL.flops(shape) == 4 * 12 * 4 * 16
    fresh = Shape("s", {**shape.dims, "q_len": 6, "prefix": 0})  # pairs 1 + 2 + 3 + 4 + 4 + 4
    assert PREFILL.flops(fresh) == 4 * 18 * 4 * 16
