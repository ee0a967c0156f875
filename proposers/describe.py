"""The op description a proposer that writes code reads: what to write, for which shapes, against
which ceilings, and what has been tried. The LLM proposer renders it into its prompt; an outside
agent reads it over MCP.

Built from the op (engine_templates), the target and the history tracking holds. It never holds
what a candidate could tune itself to instead of the op: no held-out shape, no oracle seed, no
harness source. The awkward sizes the check stage adds are named as a rule, not listed.
"""
from __future__ import annotations

import inspect
import json
import re
import textwrap
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Sequence

from engine_templates.ops import get_op
from engine_templates.ops.base import Drawn, activation_dtype
from tracking.trials import PENDING, Ceilings, Trial

if TYPE_CHECKING:
    from targets import Target
    from tracking.knowledge import Entry

# A gate's detail names the seed of the inputs it failed on (harness/judging.py): the seeds are
# the oracle's, so a description keeps the distribution and drops the number.
SEED = re.compile(r",?\s*seed -?\d+")

# The per-shape figures a kernel engineer reads, as the verdict names them (`<shape>/<metric>`).
SHAPE_METRICS = ("latency_us", "pct_roofline", "speedup_vs_eager", "speedup_vs_compile")


@dataclass(frozen=True)
class ShapeInfo:
    label: str
    dims: dict[str, int]
    bytes: int  # the fewest bytes one call must move
    flops: int
    roofline_us: float | None  # at the ceilings, where they are known


@dataclass(frozen=True)
class Tried:
    """A candidate of the history: a passed one with its per-shape figures, or a failed one
    with the gate that stopped it."""

    label: str
    candidate_id: str
    state: str
    score: float | None = None
    source: str | None = None  # a free candidate's module
    template: str | None = None
    point: dict = field(default_factory=dict)
    shapes: dict[str, dict[str, float]] = field(default_factory=dict)
    gate: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Published:
    """A published winner on a target near this one: its code and what it measured there."""

    target: str
    gpu_class: str
    device: str
    gpu_timing: bool
    entries: list[dict]  # per shape class: id, shape_class, shapes, score, vs_compile, vs_eager
    source: str | None = None  # a free kernel's module
    template: str | None = None
    point: dict = field(default_factory=dict)
    summary: str = ""


def published(group: Sequence[Entry]) -> Published:
    """One winner's published entries (tracking.knowledge.for_code's groups) as a prompt shows them."""
    e, w = group[0], group[0].winner
    source = (w.get("source") or None) if w["kind"] == "free" else None
    return Published(e.target, e.gpu_class, e.device, e.gpu_timing,
                     [{"id": x.id, "shape_class": x.shape_class, "shapes": x.shapes, "score": x.score,
                       "vs_compile": x.vs_compile, "vs_eager": x.vs_eager} for x in group],
                     source, w.get("template"), dict(w.get("point") or {}), w.get("summary", ""))


@dataclass(frozen=True)
class OpDescription:
    op: str
    signature: str
    summary: str
    arg_names: list[str]
    persistent: list[str]
    model: str
    dtype: str
    rtol: float
    reference_source: str
    eager_source: str
    inputs_source: str
    shapes: list[ShapeInfo]
    ceilings: Ceilings | None
    template: str
    template_source: str
    template_space: dict
    template_default: dict
    best: list[Tried]
    failures: list[Tried]
    tried: int  # trials in the history, pending ones included
    # Published knowledge entries for the op and the pool's GPU class (tracking.knowledge
    # .published_for): their text. A draft never gets here.
    knowledge: list[str] = field(default_factory=list)
    # The winners published on the nearest targets, nearest first: where a search starts.
    kernels: list[Published] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _source(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn)).strip()


def _shape_figures(t: Trial, labels: list[str]) -> dict[str, dict[str, float]]:
    return {label: {m: t.metrics[f"{label}/{m}"] for m in SHAPE_METRICS if f"{label}/{m}" in t.metrics}
            for label in labels if f"{label}/latency_us" in t.metrics}


def _tried(t: Trial, labels: list[str]) -> Tried:
    c = t.candidate
    return Tried(c.label, c.id, t.state, t.score, c.source if c.kind == "free" else None, c.template,
                 dict(c.point), _shape_figures(t, labels), t.gate, SEED.sub("", t.detail))


def best_passed(history: Sequence[Trial], n: int) -> list[Trial]:
    """The n best passed, timed trials, each candidate once."""
    seen, out = set(), []
    for t in sorted((t for t in history if t.state == "pass" and t.score is not None), key=lambda t: -t.score):
        if t.candidate.id not in seen and len(out) < n:
            seen.add(t.candidate.id)
            out.append(t)
    return out


def last_failures(history: Sequence[Trial], n: int) -> list[Trial]:
    """The n latest trials that did not pass, newest first."""
    done = [t for t in history if t.state not in ("pass", PENDING)]
    return sorted(done, key=lambda t: -t.started_ms)[:n]


def describe(op_name: str, target: Target, history: Sequence[Trial], ceilings: Ceilings | None = None,
             top: int = 3, failures: int = 5, knowledge: Sequence[str] = (),
             kernels: Sequence[Sequence[Entry]] = ()) -> OpDescription:
    """The description of `op_name` for `target`, given every trial tracking holds for them, the
    ceilings of the pool's GPU class (None where none were measured yet), the text of the
    published knowledge entries for the op and that class, and the published winners of the
    nearest targets (tracking.knowledge.for_code)."""
    op = get_op(op_name, target.dtype)
    dtype = activation_dtype(target.dtype)
    shapes = []
    for s in target.op_shapes(op):
        nbytes, flops = op.bytes(s, dtype), op.flops(s)
        shapes.append(ShapeInfo(s.label, dict(s.dims), nbytes, flops,
                                ceilings.roofline_us(nbytes, flops) if ceilings else None))
    labels = [s.label for s in shapes]
    template = next(iter(op.templates.values()))
    return OpDescription(
        op=op.name, signature=op.signature, summary=op.summary, arg_names=op.arg_names,
        persistent=list(op.persistent), model=target.model, dtype=target.dtype, rtol=target.tolerance,
        reference_source=_source(type(op).reference), eager_source=_source(type(op).eager),
        inputs_source=_source(type(op).draw if isinstance(op, Drawn) else type(op).inputs), shapes=shapes, ceilings=ceilings,
        template=template.name, template_source=template.source_path.read_text(),
        template_space=dict(template.space), template_default=dict(template.default),
        best=[_tried(t, labels) for t in best_passed(history, top)],
        failures=[_tried(t, labels) for t in last_failures(history, failures)],
        tried=len(history), knowledge=list(knowledge), kernels=[published(g) for g in kernels])


def _fence(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _figures(t: Tried) -> list[str]:
    rows = ["| shape | latency | % of roofline | vs eager | vs torch.compile |", "|---|---|---|---|---|"]
    for label, f in t.shapes.items():
        cell = lambda k, fmt: fmt.format(f[k]) if k in f else "-"  # noqa: E731
        rows.append(f"| {label} | {cell('latency_us', '{:.2f} us')} | {cell('pct_roofline', '{:.1f}%')} | "
                    f"{cell('speedup_vs_eager', '{:.2f}x')} | {cell('speedup_vs_compile', '{:.2f}x')} |")
    return rows


def render(d: OpDescription) -> str:
    """The description as Markdown: the body of a prompt."""
    return render_op(d) + render_history(d)


def render_op(d: OpDescription) -> str:
    """What stays the same through an optimization: the op, its shapes, ceilings and template."""
    persistent = ", ".join(d.persistent) or "none"
    out = [f"# Op `{d.signature}`", d.summary, "",
           f"Target: model `{d.model}`, dtype {d.dtype}. Outputs must match the float64 reference within "
           f"||out - ref|| / ||ref|| <= {d.rtol:g}, on fresh random inputs of several distributions.",
           f"Persistent arguments (the same on every call in the engine: you may cache what you derive from "
           f"them): {persistent}. Every other argument changes on every call, in place.",
           "", "## Reference (the oracle, in float64)", _fence(d.reference_source),
           "", "## Baseline a user would write (eager PyTorch; torch.compile of it is the other baseline)",
           _fence(d.eager_source), "", "## How the arguments are built", _fence(d.inputs_source),
           "", "## Shapes timed (the check stage adds awkward sizes too: handle any size)",
           "| shape | dims | bytes | FLOPs | roofline |", "|---|---|---|---|---|"]
    for s in d.shapes:
        roof = f"{s.roofline_us:.2f} us" if s.roofline_us is not None else "-"
        out.append(f"| {s.label} | {json.dumps(s.dims)} | {s.bytes:,} | {s.flops:,} | {roof} |")
    out += ["", "## GPU ceilings"]
    if d.ceilings:
        c = d.ceilings
        out.append(f"Measured on {c.device or c.gpu_class} (class {c.gpu_class}): copy {c.copy_bytes_per_s / 1e12:.3g} "
                   f"TB/s (bytes read + written), dense {d.dtype} matmul {c.matmul_flops_per_s / 1e12:.3g} TFLOP/s. "
                   "A time under the roofline is rejected, not recorded.")
    else:
        out.append("Not measured on this GPU class yet.")
    out += ["", f"## Starting point: template `{d.template}`",
            f"`build(**point)` returns the op's function. Space: {json.dumps(d.template_space)}; "
            f"default {json.dumps(d.template_default)}.", _fence(d.template_source), ""]
    if d.kernels:
        out += render_kernels(d.kernels)
    if d.knowledge:
        out += ["## Published knowledge: what won before, and what failed (reviewed by a person)", "",
                *d.knowledge, ""]
    return "\n".join(out) + "\n"


def _speed(x: float | None) -> str:
    return f"{x:.3g}x" if x else "-"


def render_kernels(kernels: Sequence[Published]) -> list[str]:
    out = ["## Published kernels: the winners on the nearest targets, nearest first (reviewed by a person)",
           "Each passed every gate there; its speed-ups were measured on that target, not on this one."]
    for i, k in enumerate(kernels, 1):
        timed = f"timed on {k.device or k.gpu_class}" if k.gpu_timing else "timed by the CPU interpreter"
        out += ["", f"### {i}. measured on target `{k.target}`, GPU class {k.gpu_class} ({timed})",
                *([f"> {k.summary}"] if k.summary else []), "",
                "| entry | shapes | verdict | vs best baseline | vs torch.compile | vs eager |", "|---|---|---|---|---|---|"]
        out += [f"| {e['id']} | {', '.join(e['shapes'])} | pass | {_speed(e['score'])} | {_speed(e['vs_compile'])} "
                f"| {_speed(e['vs_eager'])} |" for e in k.entries]
        out.append(_fence(k.source) if k.source is not None
                   else f"Template `{k.template}` at point {json.dumps(k.point, sort_keys=True)}.")
    return out + [""]


def render_history(d: OpDescription) -> str:
    """What has been tried: the best passed candidates and the last failures."""
    out = [f"## Best passed candidates so far ({d.tried} tried)"]
    if not d.best:
        out.append("None yet.")
    for i, t in enumerate(d.best, 1):
        out += ["", f"### {i}. {t.label}: score {t.score:.3g}x (geometric mean over shapes of the best "
                    "baseline's time over its time)", *_figures(t)]
        out.append(_fence(t.source) if t.source is not None
                   else f"Template `{t.template}` at point {json.dumps(t.point, sort_keys=True)}.")
    out += ["", "## Last failures"]
    out += [f"- {t.label}: {t.state} at gate `{t.gate or '?'}`: {t.detail}" for t in d.failures] or ["None."]
    return "\n".join(out) + "\n"
