"""Input sets drawn many at a time (`Op.input_sets`): set j holds the values `Op.inputs` draws from
`generator(device, seeds[j])` — which is how the judge draws it again — in storage of its own,
for every registered op, by the host's generator stream and by the counter draw a GPU uses."""
from __future__ import annotations

import itertools

import pytest
import torch

from engine_templates.ops import FP8_OPS, OPS, base
from engine_templates.ops.base import DISTRIBUTIONS, Drawn, generator, random_tensor
from targets import Target

MODEL = {"fused_moe": "tiny-moe", "decode_attention_swa": "tiny-swa", "prefill_attention_swa": "tiny-swa"}
SEEDS = [11, 2 ** 62 + 5, 12 + (1 << 32)]
# Ops whose every set is drawn in a few launches per argument (the rest loop over `inputs`).
BATCHED = {"rmsnorm", "fused_add_rmsnorm", "silu_mul", "gelu", "layernorm", "linear", "vision_linear",
           "rope", "qk_norm_rope", "vision_attention", "decode_attention", "decode_attention_swa",
           "prefill_attention", "prefill_attention_swa", "fused_moe"}
ALL = {**OPS, **{f"{name}-fp8": op for name, op in FP8_OPS.items()}}


def shapes(op) -> list:
    model = "sam3-tiny" if op.modality == "vision" else MODEL.get(op.name.removesuffix("_fp8"), "tiny")
    target = Target(model=model)
    return [*target.op_shapes(op)[:2], *op.odd_shapes(target.dims)]


@pytest.fixture(params=["stream", "counter", "mixed"])
def draw_by(request, monkeypatch):
    """The host's draw (its generator's own stream), or the GPU's run on the host: `counter_draw`
    for every tensor, or ("mixed") only for those under 64 elements, the others from the stream."""
    if request.param != "stream":
        monkeypatch.setattr(base, "COUNTER_DEVICES", {"cuda", "cpu"})
    if request.param == "mixed":
        monkeypatch.setattr(base, "COUNTER_MAX", 64)
    return request.param


def storages(args) -> set[int]:
    return {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}


@pytest.mark.parametrize("name", sorted(ALL))
def test_input_sets_are_the_sets_inputs_draws_one_seed_at_a_time(name, draw_by):
    op = ALL[name]
    for shape in shapes(op):
        dist = "normal" if draw_by == "stream" else DISTRIBUTIONS[len(shape.label) % len(DISTRIBUTIONS)]
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


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_the_counter_draw_has_the_host_draws_distribution(dist, monkeypatch):
    """Quantiles of 250,000 values of each distribution, by the counter draw and by torch's own
    generator, agree to what sampling allows; and no seed's draw repeats another's."""
    host = random_tensor((250_000,), torch.float32, "cpu", generator("cpu", 1), dist)
    monkeypatch.setattr(base, "COUNTER_DEVICES", {"cuda", "cpu"})
    gen = generator("cpu", 1)
    counter = random_tensor((250_000,), torch.float32, "cpu", gen, dist)
    again = random_tensor((250_000,), torch.float32, "cpu", gen, dist)  # the generator moved on
    q = torch.tensor([0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999])
    if dist == "heavy":  # magnitudes log-normal: compare their logs, and the signs' balance
        host_q, counter_q = torch.quantile(host.abs().log(), q), torch.quantile(counter.abs().log(), q)
        assert abs((counter > 0).float().mean() - 0.5) < 0.005
    else:
        host_q, counter_q = torch.quantile(host, q), torch.quantile(counter, q)
    assert not torch.equal(counter, host)  # two ways of drawing
    assert torch.allclose(counter_q, host_q, atol=0.06), (counter_q, host_q)
    assert counter.unique().numel() > 0.99 * host.unique().numel()  # as few repeated values as float32 has
    assert (counter != again).float().mean() > 0.99
    if dist == "uniform":
        assert -2 <= counter.min() and counter.max() <= 2


def test_the_counter_draw_does_not_depend_on_its_chunks(monkeypatch):
    """A tensor larger than `DRAW_CHUNK`, and many sets at once, cut where they are cut."""
    monkeypatch.setattr(base, "COUNTER_DEVICES", {"cuda", "cpu"})
    whole = base.random_stack((3, 1000), torch.bfloat16, "cpu", [generator("cpu", s) for s in SEEDS], "normal")
    monkeypatch.setattr(base, "DRAW_CHUNK", 700)
    cut = base.random_stack((3, 1000), torch.bfloat16, "cpu", [generator("cpu", s) for s in SEEDS], "normal")
    assert torch.equal(whole, cut)
    high = base.random_stack((1000,), torch.bfloat16, "cpu", [generator("cpu", 7), generator("cpu", 7 + (1 << 40))],
                             "normal")
    assert (high[0] != high[1]).float().mean() > 0.9, "seeds that differ in their high word only draw alike"


@pytest.mark.parametrize("name", sorted(BATCHED))
def test_many_sets_cost_one_counter_draw_per_argument(name, monkeypatch):
    """Where the counter draw serves (a GPU; here forced on the host), 64 sets of a shape are
    drawn by one `counter_draw` per random argument, as one set is: not one per set."""
    monkeypatch.setattr(base, "COUNTER_DEVICES", {"cuda", "cpu"})
    calls = []
    draw = base.counter_draw
    monkeypatch.setattr(base, "counter_draw", lambda seeds, *a: calls.append(len(seeds)) or draw(seeds, *a))
    op = OPS[name]
    shape = shapes(op)[0]
    op.inputs(shape, torch.bfloat16, "cpu", generator("cpu", 1), "normal")
    per_set = len(calls)
    calls.clear()
    op.input_sets(shape, torch.bfloat16, "cpu", list(range(64)), "normal")
    assert calls == [64] * per_set


def test_counter_draws_of_neighbouring_seeds_are_unrelated(monkeypatch):
    """Seeds 0 … 7 (as scripts number their sets): no set is another's values reordered, and no
    two are correlated; nor are the two streams the heavy draw's magnitudes and signs come from."""
    monkeypatch.setattr(base, "COUNTER_DEVICES", {"cuda", "cpu"})
    sets = base.random_stack((100_000,), torch.float32, "cpu", [generator("cpu", s) for s in range(8)], "normal")
    for a, b in itertools.combinations(range(8), 2):
        assert not torch.equal(sets[a].sort().values, sets[b].sort().values), (a, b)
        assert abs(torch.corrcoef(sets[[a, b]])[0, 1]) < 0.02, (a, b)
    z = base.counter_draw([5], 0, 100_000, "normal", "cpu")[0]
    heavy = base.counter_draw([5], 0, 100_000, "heavy", "cpu")[0]
    assert torch.allclose(heavy.abs(), z.double().exp().float(), rtol=1e-6)  # the magnitudes: stream 0
    assert not torch.equal((heavy > 0).sort().values, (z > 0).sort().values)  # the signs: another stream
    assert abs(torch.corrcoef(torch.stack([heavy.sign(), z]))[0, 1]) < 0.02


def test_the_bench_stage_draws_a_shapes_sets_together(monkeypatch):
    """`prepare_shape` draws every planned set of a shape in one `input_sets` (by the counter draw,
    forced on the host: one draw per argument for all of them), set j from seed j of the plan."""
    from contract.job import Candidate, Job, Rules, Shape
    from harness.stages import prepare_shape

    monkeypatch.setattr(base, "COUNTER_DEVICES", {"cuda", "cpu"})
    calls = []
    draw = base.counter_draw
    monkeypatch.setattr(base, "counter_draw", lambda seeds, *a: calls.append(len(seeds)) or draw(seeds, *a))
    shape = Shape("s", {"tokens": 3, "hidden": 16})
    job = Job("bench", Candidate(op="rmsnorm", kind="free", source=""), "tiny", [shape], [], Rules())
    item = {"shape": "s", "sets": [31, 32, 33, 34, 35], "graph": False}
    ready = prepare_shape(job, OPS["rmsnorm"], "cpu", item, lambda *a, **k: None, lambda: True)
    _, arg_sets, _, _ = ready
    assert calls == [5, 5]  # x and weight, for all five sets at once
    for seed, args in zip(item["sets"], arg_sets):
        assert torch.equal(args[0], OPS["rmsnorm"].inputs(shape, torch.bfloat16, "cpu", generator("cpu", seed), "normal")[0])
