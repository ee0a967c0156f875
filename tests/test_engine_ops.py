"""The engine's new ops (rope, qk_norm_rope, prefill_attention, fused_moe): registered, references
checked against independent accounts (transformers' own modules, decode_attention, the ops they
fuse), eager baselines and template points through the harness's check (Triton's interpreter on a
CPU), roofline counts."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from contract.job import Shape  # noqa: E402
from engine_templates.models import PRESETS  # noqa: E402
from engine_templates.ops import get_op  # noqa: E402
from engine_templates.ops.base import DISTRIBUTIONS, generator  # noqa: E402
from harness.checks import check_call, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
CASES = {  # op -> (model preset, a non-default template point)
    "rope": ("tiny", {"tokens_per_program": 4, "num_warps": 2}),
    # tiny's 4 q + 2 k heads: a block of q heads and one of k heads with a masked tail; odd_heads'
    # 6 + 3: a block holding q and k heads both
    "qk_norm_rope": ("tiny", {"tokens_per_program": 8, "heads_per_program": 4, "num_warps": 2}),
    "prefill_attention": ("tiny", {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 1}),
    "fused_moe": ("tiny-moe", {"block_i": 16, "block_h": 32, "block_o": 32, "block_k": 32, "num_warps": 2}),
}


def shapes(op, preset):
    return op.shapes(PRESETS[preset], [1, 3], [20], [24]) + op.odd_shapes(PRESETS[preset])


def draw(op, shape, dtype, i):
    return op.inputs(shape, dtype, DEVICE, generator(DEVICE, i), DISTRIBUTIONS[i % len(DISTRIBUTIONS)])


@pytest.mark.parametrize("name", list(CASES))
def test_registered_with_a_template(name):
    op = get_op(name)
    assert op.templates and op.arg_names == op.signature[op.signature.index("(") + 1:-1].split(", ")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["eager", "default", "point"])
def test_passes_the_harness_check(name, impl, dtype):
    op = get_op(name)
    preset, point = CASES[name]
    template = next(iter(op.templates.values()))
    fn = {"eager": op.eager, "default": template.build(template.default) if impl == "default" else None,
          "point": template.build(point) if impl == "point" else None}[impl]
    for i, shape in enumerate(shapes(op, preset)):
        result = check_call(op, fn, draw(op, shape, dtype, i), dtype, DEVICE, RTOL[dtype])
        assert result.ok, f"{shape.label}: {result.gate} {result.detail}"


def test_rope_reference_matches_transformers():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    op = get_op("rope")
    q, k, cos_sin, positions = draw(op, op.odd_shapes(PRESETS["tiny"])[1], torch.float32, 0)
    half = q.shape[-1] // 2
    cos = torch.cat([cos_sin[positions, :half]] * 2, -1).double()
    sin = torch.cat([cos_sin[positions, half:]] * 2, -1).double()
    hf_q, hf_k = apply_rotary_pos_emb(q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                      cos[None], sin[None])
    ref_q, ref_k = op.reference(q, k, cos_sin, positions)
    assert torch.allclose(ref_q, hf_q[0].transpose(0, 1)) and torch.allclose(ref_k, hf_k[0].transpose(0, 1))


def _unfused(qkv, q_heads, kv_heads, q_norm, k_norm, eps, cos_sin, positions, impl: str):
    """The engine's q/k path before qk_norm_rope: contiguous per-head rows through rmsnorm, then
    rope, each the given implementation (`eager` or `reference`)."""
    rmsnorm, rope = getattr(get_op("rmsnorm"), impl), getattr(get_op("rope"), impl)
    hd = q_norm.shape[0]
    q, k, _ = (t.contiguous() for t in qkv.split((q_heads * hd, kv_heads * hd, kv_heads * hd), dim=-1))
    return rope(rmsnorm(q.view(-1, hd), q_norm, eps).view(len(qkv), q_heads, hd),
                rmsnorm(k.view(-1, hd), k_norm, eps).view(len(qkv), kv_heads, hd), cos_sin, positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_eager_is_the_unfused_engine_path_bit_for_bit(dtype):
    # What keeps the engine's eager tokens exactly what they were before the op existed.
    op = get_op("qk_norm_rope")
    for i, shape in enumerate(shapes(op, "tiny")):
        args = draw(op, shape, dtype, i)
        for out, expected in zip(op.eager(*args), _unfused(*args, impl="eager")):
            assert torch.equal(out, expected), shape.label
        for out, expected in zip(op.reference(*args), _unfused(*args, impl="reference")):
            assert torch.allclose(out, expected, rtol=1e-12, atol=0), shape.label


def test_qk_norm_rope_check_tells_the_q_norm_from_the_k_norm():
    # The oracle must see a kernel that normalizes k with q's weight, else the checks prove little.
    op = get_op("qk_norm_rope")
    args = draw(op, op.odd_shapes(PRESETS["tiny"])[1], torch.bfloat16, 3)

    def swapped(qkv, q_heads, kv_heads, q_norm, k_norm, eps, cos_sin, positions):
        return op.eager(qkv, q_heads, kv_heads, q_norm, q_norm, eps, cos_sin, positions)

    result = check_call(op, swapped, args, torch.bfloat16, DEVICE, RTOL[torch.bfloat16])
    assert not result.ok and result.gate == "accuracy"


def test_fused_moe_reference_matches_the_transformers_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    op = get_op("fused_moe")
    shape = op.shapes(PRESETS["tiny-moe"], [5], [], [])[0]
    x, logits, w_gate_up, w_down, top_k, renormalize = draw(op, shape, torch.float32, 2)
    d = shape.dims
    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
        hidden_size=d["hidden"], moe_intermediate_size=d["inter"], num_experts=d["experts"],
        num_experts_per_tok=top_k, norm_topk_prob=renormalize)).double()
    router = torch.linalg.lstsq(x.double(), logits.double()).solution.t()  # logits = x @ router.T
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(w_gate_up.double())
        block.experts.down_proj.copy_(w_down.double())
        expected = block(x.double()[None])[0]
    assert rel_error(op.reference(x, (x.double() @ router.t()), w_gate_up, w_down, top_k, renormalize),
                     expected) < 1e-6  # transformers takes the softmax in float32


def test_prefill_attention_last_row_is_decode_attention():
    # A sequence's last new token attends its whole cache: decode attention over the same pages.
    op, decode = get_op("prefill_attention"), get_op("decode_attention")
    q, k_cache, v_cache, cu, seq_lens, table, scale = draw(op, op.odd_shapes(PRESETS["tiny"])[1],
                                                           torch.float32, 1)
    last = (cu[1:] - 1).long()
    expected = decode.reference(q[last], k_cache, v_cache, seq_lens, table, scale)
    assert torch.allclose(op.reference(q, k_cache, v_cache, cu, seq_lens, table, scale)[last], expected)


def test_fused_moe_inputs_touch_exactly_the_experts_bytes_counts():
    op = get_op("fused_moe")
    for tokens in (1, 3, 50):
        shape = op.shapes(PRESETS["tiny-moe"], [tokens], [], [])[0]
        x, logits, *_ = draw(op, shape, torch.bfloat16, tokens)
        chosen = logits.float().topk(2, dim=-1).indices
        assert len(chosen.unique()) == min(8, tokens * 2)
        assert len(logits[0].unique()) == 8, "no ties among one token's logits"


def test_bytes_and_flops():
    prefill = Shape("s", {"batch": 1, "q_len": 4, "prefix": 0, "q_heads": 2, "kv_heads": 1,
                          "head_dim": 8, "block_size": 16})
    # K and V of 4 positions (1 head x 8 x 2 bytes, twice), q and out of 4 tokens x 2 heads x 8
    assert get_op("prefill_attention").bytes(prefill, torch.bfloat16) == (4 * 8 * 2 + 2 * 4 * 2 * 8) * 2
    assert get_op("prefill_attention").flops(prefill) == 4 * (1 + 2 + 3 + 4) * 2 * 8
    moe = Shape("m", {"tokens": 1, "hidden": 4, "inter": 2, "experts": 8, "top_k": 2})
    assert get_op("fused_moe").bytes(moe, torch.bfloat16) == (2 * 3 * 2 * 4 + 2 * 4 + 8) * 2
    rope = Shape("r", {"tokens": 2, "q_heads": 2, "kv_heads": 1, "head_dim": 4})
    assert get_op("rope").bytes(rope, torch.float32) == 2 * 2 * 3 * 4 * 4 + 2 * (4 * 4 + 8)
    # q and k (3 heads x 4 of 2 tokens) read and written, two weights of 4, table rows, positions
    assert get_op("qk_norm_rope").bytes(rope, torch.bfloat16) == (2 * 2 * 3 * 4 + 2 * 4) * 2 + 2 * (4 * 4 + 8)
    assert get_op("qk_norm_rope").flops(rope) == 7 * 2 * 3 * 4


def test_fused_moe_needs_an_moe_preset():
    with pytest.raises(ValueError, match="qwen3-8b is dense"):
        get_op("fused_moe").shapes(PRESETS["qwen3-8b"], [1], [], [])


def tied_logits(tokens: int, experts: int, top_k: int, tie_at_boundary: bool, gen) -> torch.Tensor:
    """Router logits with ties: in pairs among each token's top_k and in threes below them, the
    top_k-th and the next apart (the chosen set is the same under any tie order); or with only
    those two tied (then the set depends on the tie order). Multiples of 1/4: exact in bf16."""
    rank = torch.arange(experts)
    if tie_at_boundary:
        key = torch.where(rank == top_k, top_k - 1, rank)
    else:
        key = torch.where(rank < top_k, rank // 2, top_k + 1 + (rank - top_k) // 3)
    logits = torch.empty(tokens, experts)
    for t in range(tokens):
        logits[t, torch.randperm(experts, generator=gen)] = -key.float() / 4
    return logits


@pytest.mark.parametrize("tokens, top_k, renormalize, dtype", [
    (1, 1, True, torch.float32), (1, 8, False, torch.float32),
    (5, 1, False, torch.bfloat16), (5, 8, True, torch.bfloat16)])
def test_fused_moe_template_with_ties_in_the_router_logits(tokens, top_k, renormalize, dtype):
    op, template = get_op("fused_moe"), get_op("fused_moe").templates["gemv"]
    fn = template.build(template.default)
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    shape = Shape("ties", {"tokens": tokens, "hidden": 40, "inter": 24, "experts": 16, "top_k": top_k})
    x, _, w_gate_up, w_down, _, _ = op.inputs(shape, dtype, DEVICE, generator(DEVICE, 0), "normal")
    # ties that do not decide the chosen set: any top-k order is right, the harness judges
    logits = tied_logits(tokens, 16, top_k, False, gen).to(DEVICE, dtype)
    args = (x, logits, w_gate_up, w_down, top_k, renormalize)
    result = check_call(op, fn, args, dtype, DEVICE, RTOL[dtype])
    assert result.ok, f"{result.gate} {result.detail}"
    # a tie for the last slot goes to the lower expert index: the reference on the same logits,
    # each lowered by a hair in index order, is the expected output
    logits = tied_logits(tokens, 16, top_k, True, gen).to(DEVICE, dtype)
    hair = 1e-9 * torch.arange(16, dtype=torch.float64, device=DEVICE)
    expected = op.reference(x, logits.double() - hair, w_gate_up, w_down, top_k, renormalize)
    assert rel_error(fn(x, logits, w_gate_up, w_down, top_k, renormalize), expected) < RTOL[dtype]


@pytest.mark.parametrize("experts", [100, 128])
def test_fused_moe_template_routes_as_torch_over_many_experts(experts):
    from engine_templates.ops.fused_moe import route
    from engine_templates.ops.fused_moe.templates import triton_route

    logits = torch.randn(5, experts, generator=torch.Generator().manual_seed(experts)).to(DEVICE)
    for top_k, renormalize in ((8, True), (3, False)):
        weights, ids = triton_route(logits, top_k, renormalize)
        expected_weights, expected_ids = route(logits, top_k, renormalize)
        assert torch.equal(ids.long(), expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def _moe_args(tokens, top_k, renormalize, experts=16, hidden=64, inter=48, seed=0, dtype=torch.bfloat16):
    op = get_op("fused_moe")
    shape = Shape("m", {"tokens": tokens, "hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k})
    x, logits, w_gate_up, w_down, _, _ = draw(op, shape, dtype, seed)
    return x, logits, w_gate_up, w_down, top_k, renormalize


@pytest.mark.parametrize("tokens, top_k, renormalize", [
    (1, 8, True), (3, 1, False), (5, 8, False), (40, 1, True), (100, 8, True), (257, 8, False)])
def test_fused_moe_grouped_path_equals_the_loop_path(tokens, top_k, renormalize):
    from engine_templates.ops.fused_moe import grouped_moe, grouped_usable, loop_moe

    op = get_op("fused_moe")
    args = _moe_args(tokens, top_k, renormalize, seed=tokens)
    x, logits, w_gate_up, w_down = args[:4]
    if not grouped_usable(w_gate_up, w_down, x.dtype):
        pytest.skip(f"torch._grouped_mm runs no bf16 without a host sync on {DEVICE}")
    # the inputs touch min(16, tokens * top_k) experts: below 16, some experts get no pair
    used = len(logits.float().topk(top_k, dim=-1).indices.unique())
    assert used == min(16, tokens * top_k)
    grouped, loop = grouped_moe(*args), loop_moe(*args)
    assert grouped.dtype == x.dtype and grouped.shape == x.shape
    torch.testing.assert_close(grouped, loop, rtol=1.6e-2, atol=1e-3)
    expected = op.reference(*args)
    assert rel_error(grouped, expected) < RTOL[torch.bfloat16]
    assert rel_error(loop, expected) < RTOL[torch.bfloat16]


def test_fused_moe_grouped_path_with_the_first_and_last_experts_idle():
    from engine_templates.ops.fused_moe import grouped_moe, grouped_usable, loop_moe

    x, logits, w_gate_up, w_down, top_k, renormalize = _moe_args(30, 4, True, seed=7)
    if not grouped_usable(w_gate_up, w_down, x.dtype):
        pytest.skip(f"torch._grouped_mm runs no bf16 without a host sync on {DEVICE}")
    logits[:, [0, 1, 15]] = -8  # below every other logit: groups 0, 1 and the last are empty
    args = (x, logits, w_gate_up, w_down, top_k, renormalize)
    assert not {0, 1, 15} & set(logits.float().topk(top_k, dim=-1).indices.unique().tolist())
    torch.testing.assert_close(grouped_moe(*args), loop_moe(*args), rtol=1.6e-2, atol=1e-3)
    assert rel_error(grouped_moe(*args), get_op("fused_moe").reference(*args)) < RTOL[torch.bfloat16]


def test_fused_moe_eager_picks_its_path_from_shapes_dtype_and_layout():
    from engine_templates.ops.fused_moe import eager_path, grouped_mm_device, grouped_usable

    x, logits, w_gate_up, w_down, _, _ = _moe_args(10, 2, True)
    grouped = "grouped" if grouped_mm_device(x.device) else "loop"
    assert eager_path(8, 2, w_gate_up, w_down, x.dtype) == "gather"  # 16 pairs <= 16 experts
    assert eager_path(9, 2, w_gate_up, w_down, x.dtype) == grouped
    assert eager_path(9, 2, w_gate_up.float(), w_down.float(), torch.float32) == "loop"
    # hidden 68 and intermediate 44: rows of 136 and 88 bytes, not 16-byte multiples
    odd = _moe_args(10, 2, True, hidden=68, inter=44)
    assert not grouped_usable(odd[2], odd[3], x.dtype)
    # the same sizes in weights whose rows are padded to 72 and 48: aligned weights, but x's and
    # the activations' rows (68 and 44 wide) are not
    padded_gu = torch.zeros(16, 88, 72, dtype=x.dtype, device=x.device)[:, :, :68].copy_(odd[2])
    padded_down = torch.zeros(16, 68, 48, dtype=x.dtype, device=x.device)[:, :, :44].copy_(odd[3])
    assert not grouped_usable(padded_gu, padded_down, x.dtype)
    # a weight starting one element into its storage: torch._grouped_mm wants 16-byte aligned data
    shifted = torch.empty(w_gate_up.numel() + 1, dtype=w_gate_up.dtype, device=w_gate_up.device)
    shifted = shifted[1:].view(w_gate_up.shape).copy_(w_gate_up)
    assert not grouped_usable(shifted, w_down, x.dtype)
    assert grouped_usable(shifted.clone(), w_down, x.dtype) == grouped_mm_device(x.device)


def test_fused_moe_eager_falls_back_to_the_loop_where_grouped_mm_refuses():
    from engine_templates.ops.fused_moe import grouped_mm_device, grouped_moe

    op = get_op("fused_moe")
    x, logits, w_gate_up, w_down, top_k, renormalize = _moe_args(20, 2, True, hidden=68, inter=44, seed=3)
    args = (x, logits, w_gate_up, w_down, top_k, renormalize)
    if grouped_mm_device(x.device):  # the check eager_path makes is what keeps this from failing
        with pytest.raises(RuntimeError, match="16 bytes"):
            grouped_moe(*args)
    assert rel_error(op.eager(*args), op.reference(*args)) < RTOL[torch.bfloat16]


def test_rope_is_checked_on_views_of_the_qkv_rows_as_the_engine_calls_it():
    """A kernel that takes q and k as packed tensors passes the packed shapes and fails the views."""
    op = get_op("rope")
    odd = {s.label: s for s in op.odd_shapes(PRESETS["tiny"])}["odd_qkv_views"]
    q, k, cos_sin, positions = args = draw(op, odd, torch.float32, 0)
    assert not q.is_contiguous() and q.stride(1) == 16 and q.stride(0) == (4 + 2 * 2) * 16

    def packed(q, k, cos_sin, positions):
        def pack(x):
            return x.as_strided(x.shape, (x.shape[1] * x.shape[2], x.shape[2], 1))
        return op.eager(pack(q), pack(k), cos_sin, positions)

    assert check_call(op, op.eager, args, torch.float32, DEVICE, 1e-4).ok
    assert not check_call(op, packed, args, torch.float32, DEVICE, 1e-4).ok
    packed_shape = op.odd_shapes(PRESETS["tiny"])[0]
    assert check_call(op, packed, draw(op, packed_shape, torch.float32, 0), torch.float32, DEVICE, 1e-4).ok
