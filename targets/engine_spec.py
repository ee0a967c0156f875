"""An engine spec file: a server the user already runs (vLLM, SGLang, this project's engine)
described as a command template and the knobs it takes, so that its flags are searched through
the same gates as this project's engine (docs/end-to-end.md#engine-spec-files).

The file is validated whole when loaded: a placeholder naming no knob, a knob no placeholder uses,
a default outside its knob's range, a condition on an unknown knob are refused, one line naming it.
Rendering fills in the knobs and leaves the stage's own placeholders ({port}, {model_dir},
{served_model_name}, {replica}, {python}, {max_model_len}) to the host that starts the server.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, model_validator

from contract.serve import EngineCandidate

# The stage's placeholders, filled in where the server starts (harness/serve/stage.py, command_argv,
# which names the served model {name}): {python} is the host's interpreter, {max_model_len} the target's.
STAGE = {"port": "port", "model_dir": "model_dir", "served_model_name": "name", "replica": "replica",
         "python": "python", "max_model_len": "max_model_len"}
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
SHIPPED = Path(__file__).resolve().parent / "engines"  # the spec files shipped with infersmith, by engine name
Value = Union[bool, int, float, str]


class SpecError(ValueError):
    """The spec file cannot be used; one line naming what and where."""


class Knob(BaseModel):
    """One flag's values: `int` or `float` from low to high by step, `choice` among choices, or `bool`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["int", "float", "choice", "bool"]
    default: Value
    low: float | None = None
    high: float | None = None
    step: float | None = Field(None, gt=0)
    choices: list[Value] | None = None
    # What {name} becomes: this text with {value} (and other knobs' placeholders) filled in, or per
    # value its own text; absent: the value itself.
    arg: str | dict[Value, str] | None = None
    when: dict[str, Value | list[Value]] | None = None  # applies only while these knobs have these values

    @model_validator(mode="after")
    def _shape(self) -> Knob:
        numeric = self.type in ("int", "float")
        if numeric and (self.low is None or self.high is None or self.low > self.high):
            raise ValueError(f"an {self.type} knob needs low <= high")
        if self.type == "choice" and not self.choices:
            raise ValueError("a choice knob needs choices")
        if not numeric and (self.low, self.high, self.step) != (None, None, None):
            raise ValueError(f"a {self.type} knob takes no low, high or step")
        return self

    def values(self) -> list[Value]:
        """Every value it takes, in order."""
        if self.type == "bool":
            return [False, True]
        if self.type == "choice":
            return list(self.choices)
        step = self.step or (1 if self.type == "int" else None)
        if step is None:
            raise SpecError("a float knob without a step has no list of values")
        n = int((self.high - self.low) / step + 1e-9) + 1
        return [self.cast(self.low + i * step) for i in range(n)]

    def cast(self, v: Any) -> Value:
        return int(round(v)) if self.type == "int" else round(float(v), 9) if self.type == "float" else v

    def holds(self, v: Any) -> bool:
        if self.type == "bool":
            return isinstance(v, bool)
        if self.type == "choice":
            return v in self.choices
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not self.low <= v <= self.high:
            return False
        if self.type == "int" and v != int(v):
            return False
        steps = (v - self.low) / self.step if self.step else 0
        return abs(steps - round(steps)) < 1e-6

    def text(self, v: Value) -> str:
        if isinstance(self.arg, dict):
            return self.arg[v]
        shown = str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)
        return shown if self.arg is None else self.arg.replace("{value}", shown)


class EngineSpec(BaseModel):
    """The file: which engine, the command, where it says it is ready, its environment, its knobs."""

    model_config = ConfigDict(extra="forbid")
    engine: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="names its configurations")
    version: str = Field("", description="the engine version whose flags the command uses")
    command: str
    ready_path: str = Field("/v1/models", pattern=r"^/")
    start_timeout_s: PositiveFloat = 600.0
    env: dict[str, str] = Field(default_factory=dict)
    knobs: dict[str, Knob] = Field(min_length=1)

    def check(self) -> EngineSpec:
        """What one field cannot see alone: placeholders, ranges, conditions. SpecError naming it."""
        names = list(self.knobs)
        texts = {"command": self.command} | {f"env {k}": v for k, v in self.env.items()}
        for name, knob in self.knobs.items():
            if not knob.holds(knob.default):
                raise SpecError(f"knob {name}: default {knob.default!r} is outside its range ({_range(knob)})")
            arg = knob.arg if isinstance(knob.arg, dict) else {None: knob.arg or ""}
            if isinstance(knob.arg, dict):
                missing = [v for v in knob.values() if v not in knob.arg]
                if missing or any(not knob.holds(v) for v in knob.arg):
                    raise SpecError(f"knob {name}: arg must give a text for each of its values {knob.values()}")
            texts |= {f"knob {name}'s arg" + ("" if v is None else f" for {v!r}"): t for v, t in arg.items()}
            for other, wanted in (knob.when or {}).items():
                if other not in self.knobs or names.index(other) >= names.index(name):
                    raise SpecError(f"knob {name}: when names {other}, which is not a knob declared before it")
                for v in wanted if isinstance(wanted, list) else [wanted]:
                    if not self.knobs[other].holds(v):
                        raise SpecError(f"knob {name}: when {other} is {v!r}, outside {other}'s range "
                                        f"({_range(self.knobs[other])})")
        refs = {n: {p for t in (k.arg.values() if isinstance(k.arg, dict) else [k.arg or ""])
                    for p in PLACEHOLDER.findall(t) if p in self.knobs} for n, k in self.knobs.items()}

        def walk(name: str, path: tuple[str, ...]) -> None:
            for p in refs[name]:
                if p in path:
                    raise SpecError(f"knob {name}: its arg names {p}, whose own text names it back")
                walk(p, (*path, p))

        for name in names:
            walk(name, (name,))
        used = set()
        for where, text in texts.items():
            for p in PLACEHOLDER.findall(text):
                if p not in self.knobs and p not in STAGE and not (p == "value" and where.startswith("knob")):
                    raise SpecError(f"{where}: placeholder {{{p}}} names no knob; knobs: {', '.join(names)}")
                used.add(p)
        unused = [n for n in names if n not in used]
        if unused:
            raise SpecError(f"knob {unused[0]} has no placeholder: put {{{unused[0]}}} in the command or another "
                            "knob's arg")
        return self

    # -- configurations --------------------------------------------------------------
    def applies(self, name: str, settings: dict[str, Value]) -> bool:
        """Whether the knob applies, given the settings of the knobs before it."""
        return all(settings.get(k) in (v if isinstance(v, list) else [v]) for k, v in (self.knobs[name].when or {}).items())

    def defaults(self) -> dict[str, Value]:
        return self.settle(lambda name, knob: knob.default)

    def settle(self, pick) -> dict[str, Value]:
        """Settings knob by knob in order, pick(name, knob) for each that applies given those before."""
        settings: dict[str, Value] = {}
        for name, knob in self.knobs.items():
            if self.applies(name, settings):
                settings[name] = knob.cast(pick(name, knob))
        return settings

    def holds(self, settings: dict[str, Any]) -> bool:
        """Whether these are settings of this file: each applying knob set within its range, no other."""
        try:
            return self.settle(lambda name, knob: settings[name]) == settings and all(
                self.knobs[k].holds(v) for k, v in settings.items())
        except KeyError:
            return False

    def every(self, limit: int) -> list[dict[str, Value]] | None:
        """Every configuration, or None when there are more than limit."""
        out: list[dict[str, Value]] = [{}]
        for name, knob in self.knobs.items():
            values = knob.values() if knob.type != "float" or knob.step else None
            if values is None:
                return None
            out = [s | {name: v} if self.applies(name, s) else s for s in out
                   for v in (values if self.applies(name, s) else [None])]
            if len(out) > limit:
                return None
        return out

    def candidate(self, settings: dict[str, Value], origin: str) -> EngineCandidate:
        return EngineCandidate(origin=origin, engine=self.engine, settings=dict(settings), command=self.render(settings))

    def render(self, settings: dict[str, Value]) -> str:
        """The command line of these settings, the environment first (through `env`), with the
        stage's placeholders kept and every other brace doubled, as the host's str.format wants.
        A knob that does not apply renders as nothing."""
        def fill(text: str) -> str:
            parts, at = [], 0
            for m in PLACEHOLDER.finditer(text):
                parts.append(_literal(text[at:m.start()]))
                name = m.group(1)
                if name in STAGE:
                    parts.append(f"{{{STAGE[name]}}}")
                elif name in settings:
                    parts.append(fill(self.knobs[name].text(settings[name])))
                at = m.end()
            return "".join(parts) + _literal(text[at:])

        env = " ".join(shlex.quote(f"{k}={fill(v)}") for k, v in self.env.items())
        return (f"env {env} " if env else "") + " ".join(fill(self.command).split())

    def serving(self, serving):
        """The target's serving settings for this file: the defaults are the baseline (unless the
        target names a baseline besides the reference), its start timeout and readiness path."""
        baseline = self.render(self.defaults()) if serving.baseline == "reference" else serving.baseline
        return serving.model_copy(update={"baseline": baseline, "start_timeout_s": self.start_timeout_s,
                                          "ready_path": self.ready_path})


def _literal(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _range(knob: Knob) -> str:
    if knob.type in ("int", "float"):
        return f"{knob.low:g} to {knob.high:g}" + (f" by {knob.step:g}" if knob.step else "")
    return ", ".join(map(repr, knob.values()))


def spec_path(name_or_path: str) -> Path:
    """A shipped spec by engine name (vllm, sglang, infersmith), else a file's path."""
    shipped = SHIPPED / f"{name_or_path}.yaml"
    return shipped if "/" not in name_or_path and shipped.is_file() else Path(name_or_path)


def shipped() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def load_spec(name_or_path: str) -> EngineSpec:
    """The spec file, validated whole; SpecError (one line, naming the file) when it cannot be used."""
    path = spec_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SpecError(f"cannot read engine spec {name_or_path} ({e.strerror}); shipped: "
                        f"{', '.join(shipped())}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"engine spec {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        return EngineSpec.model_validate(data).check()
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise SpecError(f"engine spec {path}: {where}: {err['msg']}") from None
    except SpecError as e:
        raise SpecError(f"engine spec {path}: {e}") from None

