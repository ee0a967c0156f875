"""The interface every op implements: reference, inputs, roofline counts, templates.

An op lives in `engine_templates/ops/<name>/`: `__init__.py` defines its `Op` subclass
(signature, shapes from a model and a workload, input generator, float64 reference, the
PyTorch baseline a user would write, bytes and FLOPs), and `templates.py` its Triton
templates with their search spaces.
"""
from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from contract.job import Shape
from engine_templates.models import ModelDims

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# A target's dtype as the ops see it: an fp8 target's weights are e4m3 with float32 scales
# (engine_templates/ops/fp8.py), and its activations and outputs are bf16.
ACTIVATIONS = {**DTYPES, "fp8": torch.bfloat16}


def activation_dtype(target_dtype: str) -> torch.dtype:
    """The activations' and outputs' dtype of a target of `target_dtype` (bf16, fp16, fp32, fp8)."""
    return ACTIVATIONS[target_dtype]

# Input distributions cycled across seeds: a kernel right only for N(0,1) does not pass.
DISTRIBUTIONS = ("normal", "uniform", "heavy", "offset")


def random_tensor(shape, dtype, device, gen: torch.Generator, dist: str, scale: float = 1.0):
    """Fresh random data in one of DISTRIBUTIONS, drawn in float32 where `gen` lives, then moved.

    The harness hands ops a generator on the device under test: drawing gigabytes of cache
    on the host would cost more than everything else in a check. On a GPU the values are a
    function of the generator's seed and each element's index (`counter_draw`), so that
    `random_stack` draws many generators' tensors in a few launches, each the same values as
    here; the generator is then seeded anew for what is drawn after (`next_seed`).
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    random_stack(shape, dtype, device, [gen], dist, scale, out=out[None])
    return out


def random_stack(shape, dtype, device, gens: list[torch.Generator], dist: str, scale: float = 1.0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor of shape (len(gens), *shape) (`out`, if given): row j is what `random_tensor`
    draws from `gens[j]`, each generator left as `random_tensor` leaves it."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}")
    at, numel = gens[0].device, math.prod(shape)
    if out is None:
        out = torch.empty((len(gens), *shape), dtype=dtype, device=device)
    if at.type in COUNTER_DEVICES and numel < COUNTER_MAX:
        seeds = [g.initial_seed() for g in gens]
        for g, s in zip(gens, seeds):
            g.manual_seed(next_seed(s))
        flat = out.view(len(gens), numel)
        rows = max(1, DRAW_CHUNK // max(1, numel))
        cols = min(max(1, numel), DRAW_CHUNK)
        for r in range(0, len(gens), rows):
            for c in range(0, numel, cols):
                raw = counter_draw(seeds[r:r + rows], c, min(numel, c + cols), dist, at)
                flat[r:r + rows, c:c + cols].copy_(raw if scale == 1 else raw * scale)
        return out
    for j, g in enumerate(gens):
        out[j] = _torch_draw(shape, g, dist) * scale
    return out


def _torch_draw(shape, gen: torch.Generator, dist: str) -> torch.Tensor:
    """One draw in float32 from the generator's own stream (on the host: sequential, fast)."""
    at = gen.device
    if dist == "normal":
        return torch.randn(shape, generator=gen, device=at)
    if dist == "uniform":
        return torch.rand(shape, generator=gen, device=at) * 4 - 2
    if dist == "heavy":  # log-normal magnitudes with random signs: outliers in every row
        t = torch.randn(shape, generator=gen, device=at).exp()
        t *= torch.sign(torch.randn(shape, generator=gen, device=at))
        return t
    return torch.randn(shape, generator=gen, device=at) * 0.5 + 3.0  # offset


# Where `random_tensor` draws by `counter_draw` rather than from the generator's stream: there one
# launch per input set would cost more host time than the draw itself. The tests add "cpu". Only
# tensors of fewer than COUNTER_MAX elements: the counter draw does ~30 passes over its elements,
# and a larger tensor's sets are few (at most 2 x L2 / 512 KiB of them: timing.rotation_count),
# so its own stream's draw, one launch a set, costs less.
COUNTER_DEVICES = {"cuda"}
COUNTER_MAX = 1 << 18
# Elements a `counter_draw` call covers at most: its int64 and float64 temporaries stay under
# ~256 MiB however many sets are drawn at once.
DRAW_CHUNK = 1 << 23
_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1


def next_seed(seed: int) -> int:
    """The seed a generator gets after a counter draw from `seed` (splitmix64, 63 bits)."""
    z = (seed + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche (xor-shift-multiply) on int64 values under 2**32, in place. The
    multipliers are under 2**31, so no product leaves the int64 range."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x2C1B3C6D).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def _symmetric(seeds: list[int], first: int, end: int, stream: int, device) -> torch.Tensor:
    """float64 2u - 1 for u uniform in (0, 1) of 32 random bits, exactly: for each seed, elements
    first … end - 1 of its stream `stream`. Each (seed, stream) gets a 64-bit key mixed on the
    host, so that seeds close together (0, 1, 2 …) or streams of one seed are unrelated, not
    shifted copies of each other."""
    if end > 1 << 32:
        raise ValueError(f"a counter draw covers 2**32 elements at most, not {end}")
    keys = [next_seed(next_seed(s ^ (stream << 62))) for s in seeds]
    keys = torch.tensor([(k & _M32, k >> 32) for k in keys], dtype=torch.int64, device=device)
    x = _mix(torch.arange(first, end, dtype=torch.int64, device=device)[None, :] ^ keys[:, :1])
    x ^= keys[:, 1:]
    return _mix(x).double().mul_(2.0 ** -31).add_(2.0 ** -32 - 1)  # (x + 0.5) / 2**32, then 2u - 1


def counter_draw(seeds: list[int], first: int, end: int, dist: str, device) -> torch.Tensor:
    """float32 (len(seeds), end - first): elements first … end - 1 of each seed's draw in `dist`,
    each a function of its seed and its index only, so drawn alike one set or many at a time, in
    any chunks, on any device: integer hashing, then the inverse normal CDF (`erfinv`), computed
    element by element."""
    def normal(stream: int) -> torch.Tensor:
        return torch.erfinv(_symmetric(seeds, first, end, stream, device)).mul_(math.sqrt(2))

    if dist == "normal":
        t = normal(0)
    elif dist == "uniform":  # 4u - 2
        t = _symmetric(seeds, first, end, 0, device).mul_(2)
    elif dist == "heavy":  # log-normal magnitudes with random signs: outliers in every row
        t = normal(0).exp_().mul_(torch.sign(normal(1)))
    else:  # offset
        t = normal(0).mul_(0.5).add_(3.0)
    return t.float()


def generator(device: str, seed: int) -> torch.Generator:
    """The generator ops draw inputs from: on the device under test."""
    return torch.Generator(device=device).manual_seed(seed)


def unstack(t: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a `random_stack`, each copied to its own storage (one multi-tensor copy on a
    GPU): no input set is a view of another's memory, as none is when drawn one by one."""
    if t.shape[0] == 1:  # one set: the stack's storage is that set's alone
        return [t[0]]
    rows = [torch.empty(t.shape[1:], dtype=t.dtype, device=t.device) for _ in range(t.shape[0])]
    if rows:
        torch._foreach_copy_(rows, list(t.unbind(0)))
    return rows


def copies(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`n` copies of a tensor every input set holds the same values of (a constant table), each
    in its own storage as when each set builds its own."""
    return unstack(t[None].expand(n, *t.shape))


@dataclass(frozen=True)
class Template:
    """A Triton kernel family: `build(point)` returns a function with the op's signature."""

    name: str
    module: str  # dotted module path holding `build` and the kernel
    space: dict[str, list[Any]]
    default: dict[str, Any] = field(default_factory=dict)

    def build(self, point: dict[str, Any]) -> Callable[..., Any]:
        unknown = set(point) - set(self.space)
        missing = set(self.space) - set(point)
        if unknown or missing:
            raise ValueError(f"point {point} does not match the space of {self.name} "
                             f"(unknown {sorted(unknown)}, missing {sorted(missing)})")
        for k, v in point.items():
            if v not in self.space[k]:
                raise ValueError(f"{self.name}: {k}={v!r} is not one of {self.space[k]}")
        return importlib.import_module(self.module).build(**point)

    @property
    def source_path(self) -> Path:
        return Path(importlib.import_module(self.module).__file__)

    def size(self) -> int:
        n = 1
        for v in self.space.values():
            n *= len(v)
        return n


class Op(ABC):
    """One op. Subclasses are stateless; the registry holds one instance of each."""

    name: str
    signature: str  # e.g. "rmsnorm(x, weight, eps)"
    summary: str
    n_outputs: int = 1
    templates: dict[str, Template] = {}
    # Arguments that stay the same from call to call in a real engine: weights and tables built
    # once at load (rope's cos/sin cache, MoE experts). A candidate may cache what it derives
    # from them; everything else (activations, the KV cache, lengths, block tables, router
    # logits) changes every step, and the harness's caching probe refills it in place.
    persistent: tuple[str, ...] = ()
    # "vision": an op of a vision model, whose `shapes` take its dims (engine_templates/vision.py) and
    # whose batch list is images per batch (the other two lists empty); "text": a language model's.
    modality: str = "text"

    @abstractmethod
    def shapes(self, model: ModelDims, decode_batches: list[int], prefill_tokens: list[int],
               contexts: list[int]) -> list[Shape]:
        """The target's shapes: what is timed and what counts."""

    @abstractmethod
    def odd_shapes(self, model: ModelDims) -> list[Shape]:
        """Awkward sizes (not multiples of anything) that are checked but not timed."""

    @abstractmethod
    def inputs(self, shape: Shape, dtype: torch.dtype, device: str, gen: torch.Generator,
               dist: str) -> tuple:
        """Fresh positional arguments for one call."""

    @abstractmethod
    def reference(self, *args) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The oracle: computed in float64 from the same arguments, cast to the inputs' dtype never."""

    @abstractmethod
    def eager(self, *args) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The PyTorch baseline a user would write, in the op's own dtype."""

    @abstractmethod
    def bytes(self, shape: Shape, dtype: torch.dtype) -> int:
        """The fewest bytes one call must move: each input read once, each output written once."""

    @abstractmethod
    def flops(self, shape: Shape) -> int:
        """Floating-point operations of one call."""

    @property
    def oracle(self) -> Op:
        """The op whose inputs (drawn from the same generator) and reference judge this one's
        outputs: itself, or for a quantized variant the full-precision op (ops/fp8.py)."""
        return self

    @property
    def arg_names(self) -> list[str]:
        inside = self.signature[self.signature.index("(") + 1: self.signature.rindex(")")]
        return [a.strip() for a in inside.split(",") if a.strip()]

    def input_sets(self, shape: Shape, dtype: torch.dtype, device: str, seeds: list[int], dist: str) -> list[tuple]:
        """One input set per seed, set j the same values as `inputs` draws from
        `generator(device, seeds[j])` (the judge draws a set again from its seed alone), each
        tensor in its own storage. This default draws them one by one; `Drawn` ops draw each
        argument of every set at once."""
        return [self.inputs(shape, dtype, device, generator(device, s), dist) for s in seeds]

    def is_persistent(self, i: int) -> bool:
        """Whether positional argument `i` is one of the op's declared persistent arguments."""
        return self.arg_names[i] in self.persistent


class Drawn:
    """For an op whose arguments are drawn by `random_stack`: `draw` builds the input sets of
    several generators at once, and `inputs` (one set) and `input_sets` (many, in a few launches
    per argument whatever their number) both go through it. Put before `Op` in the bases."""

    def draw(self, shape: Shape, dtype: torch.dtype, device: str, gens: list[torch.Generator],
             dist: str) -> list[tuple]:
        """One input set per generator, in order."""
        raise NotImplementedError

    def inputs(self, shape, dtype, device, gen, dist):
        return self.draw(shape, dtype, device, [gen], dist)[0]

    def input_sets(self, shape, dtype, device, seeds, dist):
        return self.draw(shape, dtype, device, [generator(device, s) for s in seeds], dist)
