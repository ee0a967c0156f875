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
    on the host would cost more than everything else in a check.
    """
    return (_finish(_raw(shape, gen, dist), dist) * scale).to(device=device, dtype=dtype)


# Elements of float32 a `random_stack` holds at once before casting: 64 MiB, however many sets.
DRAW_CHUNK = 1 << 24


def random_stack(shape, dtype, device, gens: list[torch.Generator], dist: str, scale: float = 1.0) -> torch.Tensor:
    """One tensor of shape (len(gens), *shape), row j what `random_tensor` draws from `gens[j]`
    (each generator's stream used as `random_tensor` uses it, so the same values to the bit):
    one launch per set for the draw itself (a generator holds one stream), and everything after
    it (the distribution's affine map, the scale, the cast) once for every set of a chunk."""
    if len(gens) == 1:  # one set (`inputs`, the judge's draws): no stack to build
        return random_tensor(shape, dtype, device, gens[0], dist, scale)[None]
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}")
    out = torch.empty((len(gens), *shape), dtype=dtype, device=device)
    rows = max(1, DRAW_CHUNK // max(1, math.prod(shape)))
    for r in range(0, len(gens), rows):
        raws = [_raw(shape, g, dist) for g in gens[r:r + rows]]
        raw = raws[0][None] if len(raws) == 1 else torch.stack(raws)  # a set past DRAW_CHUNK: not copied
        del raws
        raw = _finish(raw, dist)
        out[r:r + rows] = raw if scale == 1 else raw * scale  # x * 1 is x, exactly
    return out


def _raw(shape, gen: torch.Generator, dist: str) -> torch.Tensor:
    """The draw from the generator's stream, in float32: what `_finish` maps element by element."""
    at = gen.device
    if dist == "uniform":
        return torch.rand(shape, generator=gen, device=at)
    if dist == "heavy":  # log-normal magnitudes with random signs: outliers in every row
        t = torch.randn(shape, generator=gen, device=at).exp()  # per set: exp's last bit may depend on the layout
        t *= torch.sign(torch.randn(shape, generator=gen, device=at))
        return t
    if dist in ("normal", "offset"):
        return torch.randn(shape, generator=gen, device=at)
    raise ValueError(f"unknown distribution {dist!r}")


def _finish(t: torch.Tensor, dist: str) -> torch.Tensor:
    """The distribution's affine map of a `_raw` draw (exact in any layout: one rounding per op)."""
    if dist == "uniform":
        return t * 4 - 2
    if dist == "offset":
        return t * 0.5 + 3.0
    return t


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
        argument of every set together (`random_stack`)."""
        return [self.inputs(shape, dtype, device, generator(device, s), dist) for s in seeds]

    def is_persistent(self, i: int) -> bool:
        """Whether positional argument `i` is one of the op's declared persistent arguments."""
        return self.arg_names[i] in self.persistent


class Drawn:
    """For an op whose tensors are drawn by `random_stack`: `draw` builds the input sets of
    several generators at once, and `inputs` (one set) and `input_sets` (many: one launch per
    set and argument for the draw, the rest once for all) both go through it, so that the two
    cannot differ. Put before `Op` in the bases."""

    def draw(self, shape: Shape, dtype: torch.dtype, device: str, gens: list[torch.Generator],
             dist: str) -> list[tuple]:
        """One input set per generator, in order."""
        raise NotImplementedError

    def inputs(self, shape, dtype, device, gen, dist):
        return self.draw(shape, dtype, device, [gen], dist)[0]

    def input_sets(self, shape, dtype, device, seeds, dist):
        return self.draw(shape, dtype, device, [generator(device, s) for s in seeds], dist)
