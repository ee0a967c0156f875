"""Input sets drawn together (`Op.input_sets`): set j holds, to the bit, the values `Op.inputs`
draws from `generator(device, seeds[j])` — which is how the judge draws it again — in storage of
its own, for every registered op and input distribution; and the work after each set's random
draw is done once for all the sets."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_templates.ops import FP8_OPS, OPS, base
from engine_templates.ops.base import DISTRIBUTIONS, Drawn, generator
from targets import Target

MODEL = {"fused_moe": "tiny-moe", "decode_attention_swa": "tiny-swa", "prefill_attention_swa": "tiny-swa"}
SEEDS = [11, 2 ** 62 + 5, 12 + (1 << 32)]
# Every op draws its sets together (`Drawn`); a new op may leave it to the default loop.
BATCHED = {"rmsnorm", "fused_add_rmsnorm", "silu_mul", "gelu", "layernorm", "linear", "vision_linear",
           "rope", "qk_norm_rope", "vision_attention", "decode_attention", "decode_attention_swa",
           "prefill_attention", "prefill_attention_swa", "fused_moe"}
ALL = {**OPS, **{f"{name}-fp8": op for name, op in FP8_OPS.items()}}


def shapes(op) -> list:
    model = "sam3-tiny" if op.modality == "vision" else MODEL.get(op.name.removesuffix("_fp8"), "tiny")
    target = Target(model=model)
    return [*target.op_shapes(op)[:2], *op.odd_shapes(target.dims)]


def storages(args) -> set[int]:
    return {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}


class Dispatched(TorchDispatchMode):
    """Counts the ATen operations run inside it: on a GPU, each is a launch or an allocation."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("name", sorted(ALL))
def test_input_sets_are_the_sets_inputs_draws_one_seed_at_a_time(name, dist):
    op = ALL[name]
    for shape in shapes(op):
        batch = op.input_sets(shape, torch.bfloat16, "cpu", SEEDS, dist)
        one = [op.inputs(shape, torch.bfloat16, "cpu", generator("cpu", s), dist) for s in SEEDS]
        assert len(batch) == len(SEEDS)
        for j, (got, want) in enumerate(zip(batch, one)):
            assert len(got) == len(want)
            for i, (a, b) in enumerate(zip(got, want)):
                where = f"{shape.label} set {j} argument {i}"
                assert type(a) is type(b), where
                if isinstance(a, torch.Tensor):
                    assert (a.shape, a.dtype, a.device, a.stride(), a.is_contiguous()) == \
                           (b.shape, b.dtype, b.device, b.stride(), b.is_contiguous()), where
                    assert torch.equal(a, b), where
                else:
                    assert a == b, where
        for (j, x), (k, y) in itertools.combinations(enumerate(batch), 2):
            assert not storages(x) & storages(y), f"{shape.label}: sets {j} and {k} share storage"
            assert any(isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(x, y)), \
                f"{shape.label}: sets {j} and {k} are equal"


def test_the_batched_ops_are_the_drawn_ones():
    assert {name for name, op in OPS.items() if isinstance(op, Drawn)} == BATCHED


def test_a_stack_does_not_depend_on_its_chunks(monkeypatch):
    """Sets drawn a chunk at a time (`DRAW_CHUNK`) are the sets drawn all at once."""
    whole = base.random_stack((3, 100), torch.bfloat16, "cpu", [generator("cpu", s) for s in range(7)], "offset", 0.5)
    monkeypatch.setattr(base, "DRAW_CHUNK", 700)  # two sets a chunk
    cut = base.random_stack((3, 100), torch.bfloat16, "cpu", [generator("cpu", s) for s in range(7)], "offset", 0.5)
    assert torch.equal(whole, cut)
    monkeypatch.setattr(base, "DRAW_CHUNK", 100)  # a set larger than a chunk: one at a time
    assert torch.equal(whole, base.random_stack((3, 100), torch.bfloat16, "cpu", [generator("cpu", s) for s in range(7)],
                                                "offset", 0.5))
    assert torch.equal(cut[6], base.random_tensor((3, 100), torch.bfloat16, "cpu", generator("cpu", 6), "offset", 0.5))


@pytest.mark.parametrize("name", sorted(BATCHED))
def test_many_sets_cost_fewer_operations_than_one_by_one(name):
    """64 sets drawn together dispatch fewer ATen operations (on a GPU: launches and allocations)
    than 64 drawn one by one; for an op of plain random tensors, at most half as many."""
    op = OPS[name]
    shape = shapes(op)[0]
    with Dispatched() as together:
        op.input_sets(shape, torch.bfloat16, "cpu", list(range(64)), "normal")
    with Dispatched() as one_by_one:
        for s in range(64):
            op.inputs(shape, torch.bfloat16, "cpu", generator("cpu", s), "normal")
    plain = name in {"rmsnorm", "fused_add_rmsnorm", "silu_mul", "gelu", "layernorm", "vision_linear", "linear"}
    assert together.count * (2 if plain else 1) < one_by_one.count, (together.count, one_by_one.count)


def test_the_bench_stage_draws_a_shapes_sets_together():
    """`prepare_shape` draws every planned set of a shape in one `input_sets`: set j from seed j
    of the plan, with the dispatches of drawing them together."""
    from contract.job import Candidate, Job, Rules, Shape
    from harness.stages import prepare_shape

    op, shape = OPS["rmsnorm"], Shape("s", {"tokens": 3, "hidden": 16})
    job = Job("bench", Candidate(op="rmsnorm", kind="free", source=""), "tiny", [shape], [], Rules())
    item = {"shape": "s", "sets": list(range(100, 164)), "graph": False}
    with Dispatched() as prepared:
        _, arg_sets, _, _ = prepare_shape(job, op, "cpu", item, lambda *a, **k: None, lambda: True)
    with Dispatched() as together:
        op.input_sets(shape, torch.bfloat16, "cpu", item["sets"], "normal")
    assert prepared.count == together.count
    for seed, args in zip(item["sets"], arg_sets, strict=True):
        want = op.inputs(shape, torch.bfloat16, "cpu", generator("cpu", seed), "normal")
        assert torch.equal(args[0], want[0]) and torch.equal(args[1], want[1])
