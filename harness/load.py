"""Turn a Candidate into a callable: build a template point, or import a free module."""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from contract.job import Candidate


class Rejected(Exception):
    """The candidate cannot be run; `gate` names the gate that says so."""

    def __init__(self, gate: str, detail: str):
        super().__init__(f"{gate}: {detail}")
        self.gate, self.detail = gate, detail


def check_signature(fn: Any, name: str, arg_names: list[str]) -> None:
    if not callable(fn):
        raise Rejected("signature", f"`{name}` is not a function")
    try:
        inspect.signature(fn).bind(*arg_names)
    except (TypeError, ValueError) as e:
        raise Rejected("signature", f"`{name}` must accept ({', '.join(arg_names)}): {e}") from None


def load(candidate: Candidate, op, workdir: Path) -> Callable[..., Any]:
    if candidate.kind == "template":
        template = op.templates.get(candidate.template)
        if template is None:
            raise Rejected("load", f"{op.name} has no template {candidate.template!r}")
        try:
            fn = template.build(candidate.point)
        except ValueError as e:
            raise Rejected("load", str(e)) from None
        check_signature(fn, op.name, op.arg_names)
        return fn
    return load_free(candidate.source or "", op, workdir, candidate.id)


def load_free(source: str, op, workdir: Path, tag: str) -> Callable[..., Any]:
    """Import the candidate from its own file in the scratch directory, under a private name."""
    try:
        compile(source, "candidate.py", "exec")
    except SyntaxError as e:
        raise Rejected("load", f"syntax error at line {e.lineno}: {e.msg}") from None
    path = workdir / "candidate.py"
    path.write_text(source)
    mod_name = f"infersmith_candidate_{tag}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the candidate's own import-time failure is its verdict
        raise Rejected("load", f"importing the candidate raised {type(e).__name__}: {e}") from None
    fn = getattr(module, op.name, None)
    if fn is None:
        raise Rejected("signature", f"the candidate defines no function `{op.name}`")
    check_signature(fn, op.name, op.arg_names)
    return fn
