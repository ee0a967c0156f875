"""The hot ops the model calls, each taken from the op registry as a kernels file says.

A kernels file is JSON mapping op name to where its implementation comes from:

    {"rmsnorm":          {"impl": "template", "template": "rows", "point": {"block_n": 0, ...}},
     "decode_attention": {"impl": "free", "path": "candidates/decode.py"},
     "qk_norm_rope":     {"impl": "reference"},
     "silu_mul":         {"impl": "eager"}}

`eager` (the default for every op the file does not name) is the op's PyTorch baseline;
`reference` its float64 oracle, cast back to the input dtype (slow; for debugging);
`template` a Triton template point (`point` left out: the template's default);
`free` a Python file defining a function named after the op, e.g. a candidate that passed the gates.

A template module may declare MAX_TOKENS, the largest call it is meant for (fused_moe's decode-
shaped `gemv`): the engine then runs fused_moe calls with more tokens through the op's eager,
where eager takes its grouped path for them (MoEPrefillRoute), and records that in its choices.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from engine_templates.engine.config import EngineSetupError, KernelSpec
from engine_templates.ops import OPS
from engine_templates.ops.fused_moe import eager_path, grouped_usable

log = logging.getLogger("infersmith.engine")

# qk_norm_rope where the architecture normalizes q and k per head (Qwen3), rope where it does not;
# the attention ops' *_swa where the model's sliding window is shorter than the served context
ENGINE_OPS = ("rmsnorm", "fused_add_rmsnorm", "silu_mul", "qk_norm_rope", "rope", "decode_attention",
              "prefill_attention", "fused_moe", "decode_attention_swa", "prefill_attention_swa")
IMPLS = ("reference", "eager", "template", "free")
FIELD_TYPES = {"impl": (str, "a string"), "template": (str, "a template's name"),
               "point": (dict, 'an object of the template\'s parameters, e.g. {"block_n": 0}'),
               "path": (str, "a file path (a string)")}


class KernelFileError(EngineSetupError):
    """A kernels file or kernel choice that cannot be used."""


def parse_kernels_file(path: Path, ops: tuple[str, ...] = ENGINE_OPS) -> dict[str, KernelSpec]:
    """The file's choices, each for one of `ops` (default: the text engine's)."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise KernelFileError(f"cannot read kernels file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise KernelFileError(f"{path}: not a text file (not UTF-8)") from None
    except json.JSONDecodeError as e:
        raise KernelFileError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(raw, dict):
        raise KernelFileError(f"{path}: expected an object mapping op name to its choice")
    specs = {}
    for op, choice in raw.items():
        where = f"{path}: {op}"
        if op not in ops:
            raise KernelFileError(f"{where}: not an op the engine uses ({', '.join(ops)})")
        if not isinstance(choice, dict) or choice.get("impl") not in IMPLS:
            raise KernelFileError(f"{where}: expected {{\"impl\": one of {', '.join(IMPLS)}, ...}}")
        unknown = set(choice) - set(FIELD_TYPES)
        if unknown:
            raise KernelFileError(f"{where}: unknown keys {sorted(unknown)}")
        for key, (kind, says) in FIELD_TYPES.items():
            if key in choice and not isinstance(choice[key], kind):
                raise KernelFileError(f"{where}: {key} must be {says}, not {json.dumps(choice[key])}")
        path_field = choice.get("path", "")
        if path_field and not Path(path_field).is_absolute():
            path_field = str(Path(path).parent / path_field)  # relative to the kernels file
        specs[op] = KernelSpec(impl=choice["impl"], template=choice.get("template", ""),
                               point=dict(choice.get("point", {})), path=path_field)
    return specs


def _cast_like_input(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The float64 reference, its outputs cast back to the dtype of the first tensor argument."""
    def call(*args):
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
        out = fn(*args)
        if isinstance(out, tuple):
            return tuple(o.to(dtype) for o in out)
        return out.to(dtype)
    return call


def _load_free(op_name: str, path: str) -> Callable[..., Any]:
    file = Path(path)
    if not file.is_file():
        raise KernelFileError(f"{op_name}: no such candidate file {path}")
    spec = importlib.util.spec_from_file_location(f"infersmith_kernel_{op_name}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise KernelFileError(f"{op_name}: {path} has a syntax error at line {e.lineno}") from None
    fn = getattr(module, op_name, None)
    if not callable(fn):
        raise KernelFileError(f"{op_name}: {path} defines no function `{op_name}`")
    return fn


def resolve(op_name: str, spec: KernelSpec) -> Callable[..., Any]:
    op = OPS[op_name]
    if spec.impl == "eager":
        return op.eager
    if spec.impl == "reference":
        return _cast_like_input(op.reference)
    if spec.impl == "free":
        return _load_free(op_name, spec.path)
    template = op.templates.get(spec.template or next(iter(op.templates)))
    if template is None:
        raise KernelFileError(f"{op_name}: no template {spec.template!r}; "
                              f"known: {', '.join(op.templates)}")
    try:
        return template.build(spec.point or template.default)
    except ValueError as e:
        raise KernelFileError(f"{op_name}: {e}") from None


class MoEPrefillRoute:
    """fused_moe from a template declared for at most `max_tokens` tokens (its module's
    MAX_TOKENS), with calls of more tokens sent to the op's eager wherever eager takes its
    grouped path for them (grouped GEMMs: each expert's weights read once per call, where the
    template reads them once per token and slot). Where eager would take its per-expert loop (a
    host sync; it lost to the gemv template at 512 tokens on the H200), and under CUDA graph
    capture, the template keeps the call. Decided from the call's shapes, dtype and device alone:
    no host sync."""

    def __init__(self, template: Callable[..., Any], max_tokens: int):
        self.template = template
        self.eager = OPS["fused_moe"].eager
        self.max_tokens = max_tokens
        # calls made from Python by side; a replayed CUDA graph adds none
        self.calls = {"template": 0, "eager": 0}

    def choose(self, x, router_logits, w_gate_up, w_down, top_k, renormalize) -> Callable[..., Any]:
        tokens = x.shape[0]
        # Under CUDA graph capture (decode graphs of more rows than max_tokens, when configured)
        # the template keeps the call: capturing torch._grouped_mm is not yet verified on a GPU.
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if (tokens > self.max_tokens and not capturing
                and eager_path(tokens, top_k, w_gate_up, w_down, x.dtype) == "grouped"):
            return self.eager
        return self.template

    def __call__(self, x, router_logits, w_gate_up, w_down, top_k, renormalize):
        fn = self.choose(x, router_logits, w_gate_up, w_down, top_k, renormalize)
        self.calls["eager" if fn is self.eager else "template"] += 1
        return fn(x, router_logits, w_gate_up, w_down, top_k, renormalize)


def template_token_limit(op_name: str, template: str) -> int | None:
    """The template module's MAX_TOKENS, None where it declares none."""
    module = importlib.import_module(OPS[op_name].templates[template].module)
    return getattr(module, "MAX_TOKENS", None)


class KernelSet:
    """One callable per engine op, and a record of where each came from."""

    def __init__(self, specs: dict[str, KernelSpec]):
        unknown = set(specs) - set(ENGINE_OPS)
        if unknown:
            raise KernelFileError(f"not ops the engine uses: {sorted(unknown)}")
        self.choices: dict[str, dict[str, Any]] = {}
        for name in ENGINE_OPS:
            spec = specs.get(name, KernelSpec())
            fn = resolve(name, spec)
            choice = {"impl": spec.impl}
            if spec.impl == "template":
                template = spec.template or next(iter(OPS[name].templates))
                choice.update(template=template,
                              point=spec.point or OPS[name].templates[template].default)
                limit = template_token_limit(name, template) if name == "fused_moe" else None
                if limit is not None:
                    fn = MoEPrefillRoute(fn, limit)
            if spec.impl == "free":
                choice["path"] = spec.path
            setattr(self, name, fn)
            self.choices[name] = choice

    def settle_moe_prefill(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
                           dtype: torch.dtype) -> bool:
        """With the model's expert weights (one MoE layer's: the layers share dtype, device and
        layout), top_k and activation dtype: whether fused_moe calls over the template's token
        limit run eager's grouped path. Logged once, and recorded in `choices` where they do,
        with the token count above which they do (eager gathers up to experts / top_k tokens)."""
        route = self.fused_moe
        if not isinstance(route, MoEPrefillRoute):
            return False
        template = self.choices["fused_moe"]["template"]
        if not grouped_usable(w_gate_up, w_down, dtype):
            log.info("fused_moe: the %s template runs every call: the eager grouped path needs bf16 "
                     "weights of 16-byte rows on a device where torch._grouped_mm needs no host sync "
                     "(here %s on %s)", template, dtype, w_gate_up.device)
            return False
        above = max(route.max_tokens, w_gate_up.shape[0] // top_k)
        self.choices["fused_moe"]["prefill"] = {"impl": "eager", "path": "grouped", "above_tokens": above}
        log.info("fused_moe: calls of more than %d tokens run eager's grouped GEMMs "
                 "(torch._grouped_mm) instead of the %s template", above, template)
        return True
