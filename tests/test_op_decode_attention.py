"""decode_attention: the input generator, the oracle against a loop over positions, the eager
baseline, split_kv points through the harness's own check (Triton's interpreter on a CPU), and
the roofline counts."""
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
from engine_templates.ops.decode_attention import OP, seq_lens_for  # noqa: E402
from harness.checks import check_call, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
TEMPLATE = OP.templates["split_kv"]
POINTS = [
    TEMPLATE.default,
    {"num_splits": 1, "block_n": 16, "num_warps": 4, "num_stages": 1},  # no combine pass
    # more splits than tiles (37 positions = 3 tiles of 16): empty splits reach the combine
    {"num_splits": 8, "block_n": 16, "num_warps": 2, "num_stages": 1},
    # a tile longer than every context here, spanning many 16-position blocks
    {"num_splits": 2, "block_n": 128, "num_warps": 8, "num_stages": 3},
    # the count chosen per call from the shapes (here 1 or 2: the interpreter counts 4 SMs)
    {"num_splits": 0, "block_n": 16, "num_warps": 4, "num_stages": 1},
]
# The interpreter pays per program (batch x kv_heads x num_splits), so the checks below stay
# on small batches and short contexts; what the sizes exercise is what matters.


def tiny_shapes() -> list[Shape]:
    tiny = PRESETS["tiny"]
    return OP.shapes(tiny, [1, 3], [], [37]) + OP.odd_shapes(tiny)


def real_head_shapes() -> list[Shape]:
    # Real head counts and head_dim 128 (groups of 4 and 8 q heads), contexts kept short.
    return (OP.shapes(PRESETS["qwen3-8b"], [2], [], [40])[:1]  # paged
            + OP.shapes(PRESETS["qwen3-30b-a3b"], [3], [], [21])[1:])  # contiguous


def draw(shape, dtype, seed=0, dist="normal"):
    return OP.inputs(shape, dtype, DEVICE, generator(DEVICE, seed), dist)


def max_len(k_cache, block_table):
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def test_registered():
    assert get_op("decode_attention") is OP
    assert OP.arg_names == ["q", "k_cache", "v_cache", "seq_lens", "block_table", "scale"]


def test_shapes_cover_both_layouts_for_every_batch_and_context():
    shapes = OP.shapes(PRESETS["qwen3-8b"], [1, 32], [2048], [4096, 32768])
    assert [s.label for s in shapes] == [
        "b1_ctx4096_paged", "b1_ctx4096_contig", "b32_ctx4096_paged", "b32_ctx4096_contig",
        "b1_ctx32768_paged", "b1_ctx32768_contig", "b32_ctx32768_paged", "b32_ctx32768_contig"]
    assert shapes[2].dims == {"batch": 32, "context": 4096, "q_heads": 32, "kv_heads": 8,
                              "head_dim": 128, "paged": 1, "block_size": 16}
    assert shapes[3].dims["paged"] == 0


def test_seq_lens_vary_but_their_sum_is_fixed_by_the_shape():
    for batch, context in [(3, 37), (8, 4096), (128, 333)]:
        lens = seq_lens_for(batch, context)
        assert len(lens) == batch and max(lens) == context and min(lens) >= 1
        assert any(n % 2 for n in lens)
        assert len(set(lens)) > 1
    shape = OP.shapes(PRESETS["tiny"], [8], [], [64])[0]
    orders = {tuple(draw(shape, torch.float32, seed)[3].tolist()) for seed in range(6)}
    assert len(orders) > 1  # the order is drawn per call ...
    assert {sum(o) for o in orders} == {sum(seq_lens_for(8, 64))}  # ... the total is not


@pytest.mark.parametrize("paged", [1, 0])
def test_inputs_hide_garbage_beyond_each_sequence(paged):
    shape = [s for s in OP.shapes(PRESETS["tiny"], [8], [], [100]) if s.dims["paged"] == paged][0]
    q, k_cache, v_cache, seq_lens, block_table, scale = draw(shape, torch.float32, 3)
    assert seq_lens.dtype == torch.int32 and scale == 16 ** -0.5
    data_max = q.abs().max()  # the same distribution as the valid cache entries
    if paged:
        bs = shape.dims["block_size"]
        assert block_table.dtype == torch.int32 and block_table.shape == (8, math.ceil(100 / bs))
        used = [block_table[i, :math.ceil(n / bs)].tolist() for i, n in enumerate(seq_lens.tolist())]
        flat = [b for blocks in used for b in blocks]
        assert len(set(flat)) == len(flat), "a block belongs to one sequence"
        assert flat != sorted(flat), "blocks are handed out in no particular order"
        spare = set(range(k_cache.shape[0])) - set(flat)
        unused_entries = {b for i, blocks in enumerate(used) for b in block_table[i, len(blocks):].tolist()}
        assert unused_entries and unused_entries <= spare, "table entries past the end point at spare blocks"
        for i, n in enumerate(seq_lens.tolist()):
            rows = k_cache[block_table[i].long()].flatten(0, 1)
            assert rows[:n].abs().max() <= 10 * data_max
            if n < rows.shape[0]:
                assert v_cache[block_table[i].long()].flatten(0, 1)[n:].abs().max() > 20 * data_max
        assert v_cache[sorted(spare)].abs().max() > 20 * data_max
    else:
        assert block_table is None and k_cache.shape == (8, 100, 2, 16)
        for i, n in enumerate(seq_lens.tolist()):
            if n < 100:
                assert v_cache[i, n:].abs().max() > 20 * data_max


def loop_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    """Position by position in Python floats: an independent account of the op's definition."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            qv = q[b, h].double()
            keys, values = [], []
            for p in range(int(seq_lens[b])):
                if block_table is None:
                    where = (b, p)
                else:
                    bs = k_cache.shape[1]
                    where = (int(block_table[b, p // bs]), p % bs)
                keys.append(k_cache[where[0], where[1], h // group].double())
                values.append(v_cache[where[0], where[1], h // group].double())
            scores = [float(qv @ k) * scale for k in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[b, h] = sum(w / total * v for w, v in zip(weights, values))
    return out


def test_reference_matches_a_loop_over_positions():
    shapes = [OP.odd_shapes(PRESETS["tiny"])[i] for i in (0, 1, 2)]
    shapes.append(OP.shapes(PRESETS["qwen3-30b-a3b"], [2], [], [9])[0])  # a group of 8 q heads
    for i, shape in enumerate(shapes):
        args = draw(shape, torch.bfloat16, i, DISTRIBUTIONS[i % len(DISTRIBUTIONS)])
        expected = loop_attention(*args)
        assert torch.allclose(OP.reference(*args).cpu(), expected, rtol=1e-9, atol=1e-9), shape.label


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_matches_reference(dtype):
    for i, shape in enumerate(tiny_shapes() + real_head_shapes()):
        args = draw(shape, dtype, i, DISTRIBUTIONS[i % len(DISTRIBUTIONS)])
        out = OP.eager(*args)
        assert out.dtype == dtype and out.shape == args[0].shape and out.is_contiguous()
        assert rel_error(out, OP.reference(*args)) < RTOL[dtype], shape.label


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("point", POINTS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_template_point_passes_the_harness_check(point, dtype):
    fn = TEMPLATE.build(point)
    shapes = tiny_shapes() + (real_head_shapes() if point in POINTS[:2] else [])
    short = 0  # sequences of fewer tiles than splits: each leaves a split with no keys
    for i, shape in enumerate(shapes):
        dist = DISTRIBUTIONS[i % len(DISTRIBUTIONS)]
        args = draw(shape, dtype, i, dist)
        tiles = (args[3].cpu() + point["block_n"] - 1) // point["block_n"]
        short += int((tiles < point["num_splits"]).sum())
        result = check_call(OP, fn, args, dtype, DEVICE, RTOL[dtype])  # also: inputs unchanged
        assert result.ok, f"{shape.label} ({dist}): {result.gate} {result.detail}"
    if point == POINTS[2]:  # the point that is here for the empty splits met them
        assert short > 0, "no sequence left a split without keys"


def test_auto_splits_fill_the_gpu_for_one_sequence_and_step_aside_for_a_batch():
    from engine_templates.ops.decode_attention.templates import auto_splits

    # H200: 132 SMs; qwen3-8b: 8 kv heads, 64-position tiles
    assert auto_splits(1, 8, 4096, 64, 132) == 64  # 33 programs per pair wanted, 64 tiles
    assert auto_splits(1, 8, 32768, 64, 132) == 64  # capped
    assert auto_splits(32, 8, 4096, 64, 132) == 2
    assert auto_splits(128, 8, 32768, 64, 132) == 1
    assert auto_splits(1, 8, 100, 64, 132) == 2  # no more splits than the two tiles
    assert auto_splits(1, 8, 200, 64, 132) == 4  # 200 positions: 4 tiles, 4 splits
    assert auto_splits(1, 8, 400, 64, 132) == 4  # 7 tiles: the power of two below, 4


@pytest.mark.parametrize("layout", [1, 0])
def test_check_rejects_kernels_that_read_past_seq_len_or_ignore_the_table(layout):
    # The garbage beyond each sequence and the shuffled table must make such kernels fail.
    fn = TEMPLATE.build(POINTS[1])

    def past_the_end(q, k_cache, v_cache, seq_lens, block_table, scale):
        return fn(q, k_cache, v_cache, torch.full_like(seq_lens, max_len(k_cache, block_table)),
                  block_table, scale)

    def blocks_in_order(q, k_cache, v_cache, seq_lens, block_table, scale):
        order = torch.arange(block_table.numel(), dtype=torch.int32, device=block_table.device)
        return fn(q, k_cache, v_cache, seq_lens, order.view(block_table.shape) % k_cache.shape[0], scale)

    shape = [s for s in OP.shapes(PRESETS["tiny"], [3], [], [37]) if s.dims["paged"] == layout][0]
    for bad in (past_the_end, blocks_in_order) if layout else (past_the_end,):
        for i, dist in enumerate(DISTRIBUTIONS):
            result = check_call(OP, bad, draw(shape, torch.bfloat16, i, dist), torch.bfloat16, DEVICE, 1e-2)
            assert not result.ok and result.gate == "accuracy", (bad.__name__, dist)


def test_check_rejects_a_wrong_head_mapping():
    # q head h reads kv head h // group; h % kv_heads is the classic mistake and must not pass.
    def interleaved(q, k_cache, v_cache, seq_lens, block_table, scale):
        kv = k_cache.shape[2]
        perm = torch.arange(q.shape[1], device=q.device).view(-1, kv).t().reshape(-1)  # h -> h % kv first
        return TEMPLATE.build(POINTS[1])(q[:, perm].contiguous(), k_cache, v_cache, seq_lens,
                                                block_table, scale)[:, perm.argsort()].contiguous()

    shape = OP.shapes(PRESETS["qwen3-8b"], [2], [], [40])[0]
    result = check_call(OP, interleaved, draw(shape, torch.bfloat16), torch.bfloat16, DEVICE, 1e-2)
    assert not result.ok and result.gate == "accuracy"


def test_bytes_and_flops():
    shape = Shape("s", {"batch": 2, "context": 5, "q_heads": 4, "kv_heads": 2, "head_dim": 16,
                        "paged": 1, "block_size": 4})
    assert seq_lens_for(2, 5) == [5, 3]
    # K and V: 8 positions x 2 kv heads x 16 x 2 bytes, twice = 1024; q and out: 2 x 2 x 4 x 16 x 2
    # = 512; seq_lens: 8; table entries in use: 2 + 1 blocks x 4 bytes = 12
    assert OP.bytes(shape, torch.bfloat16) == 1556
    contig = Shape("s", {**shape.dims, "paged": 0, "block_size": 0})
    assert OP.bytes(contig, torch.bfloat16) == 1544
    assert OP.flops(shape) == 4 * 8 * 4 * 16
