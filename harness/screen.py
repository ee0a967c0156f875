"""Static screening of a free candidate's source, before anything of it runs.

The rules are data (`screen_rules.toml`): what is rejected outright (process and thread
creation, network, native code, introspection, harness access, patching of torch/time/
harness names) and what is only flagged for a person (the op's PyTorch implementation,
low precision, side streams, file access, computed attribute names). Names are resolved
through the source's own import aliases, so `import os as o; o.fork()` is `os.fork`.

Screening is a first net, not a proof: Python is dynamic enough to hide a name from any
parser. What slips through meets the runtime gates (thread count, timer identity, hashes
of the harness's files, memory watchdog, the oracle in another process).
"""
from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

RULES_FILE = Path(__file__).with_name("screen_rules.toml")
REJECT, FLAG = "reject", "flag"
# The precisions a target asks for, which the `reduced_precision` rule then does not flag: an
# fp8 target's weights are e4m3 (engine_templates/ops/fp8.py), and a kernel may name the type.
ASKED = {"fp8": ("torch.float8_e4m3fn", "tl.float8e4nv", "triton.language.float8e4nv")}
# Calls that join a side stream back to the one being timed (see `_unjoined_stream`).
_JOINS = {"wait_stream", "wait_event", "synchronize"}


@dataclass(frozen=True)
class Rule:
    id: str
    action: str
    why: str
    imports: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    assign_to: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finding:
    rule: str
    action: str
    line: int
    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.rule} (line {self.line}: {self.what}): {self.why}"


@dataclass
class Screening:
    findings: list[Finding] = field(default_factory=list)

    @property
    def rejections(self) -> list[Finding]:
        return [f for f in self.findings if f.action == REJECT]

    @property
    def flags(self) -> list[Finding]:
        return [f for f in self.findings if f.action == FLAG]


@lru_cache(maxsize=None)
def load_rules(path: Path = RULES_FILE) -> tuple[Rule, ...]:
    data = tomllib.loads(path.read_text())
    rules = []
    for r in data["rule"]:
        assert r["action"] in (REJECT, FLAG), f"rule {r['id']}: action must be reject or flag"
        rules.append(Rule(r["id"], r["action"], r["why"], tuple(r.get("imports", ())),
                          tuple(r.get("names", ())), tuple(r.get("assign_to", ()))))
    return tuple(rules)


def _under(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


class _Scanner(ast.NodeVisitor):
    def __init__(self, rules: tuple[Rule, ...]):
        self.rules, self.aliases = rules, {}
        self.findings: list[Finding] = []
        self.attr_calls: set[str] = set()

    def _hit(self, rule: Rule, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(rule.id, rule.action, getattr(node, "lineno", 0), what, rule.why))

    def _dotted(self, node: ast.AST) -> str | None:
        """`o.path.join` -> "os.path.join" when `o` is an alias of os; None for non-name chains."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def _check_import(self, module: str, node: ast.AST) -> None:
        for rule in self.rules:
            if _under(module, rule.imports) or _under(module, rule.names):
                self._hit(rule, node, f"import {module}")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            self._check_import(a.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        self._check_import(module, node)
        for a in node.names:
            full = f"{module}.{a.name}"
            self.aliases[a.asname or a.name] = full
            self._check_names(full, node)

    def _check_names(self, full: str, node: ast.AST) -> None:
        for rule in self.rules:
            if _under(full, rule.names):
                self._hit(rule, node, full)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        full = self._dotted(node)
        if full is not None:
            self._check_names(full, node)
            if not isinstance(node.ctx, ast.Load):
                self._check_assign(full, node)
            return  # the chain's inner attributes are prefixes of this one: already covered
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id not in self.aliases:  # a builtin, or a local: only builtins are in the rules
            self._check_names(node.id, node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute):
            self.attr_calls.add(node.func.attr)
        if isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr", "getattr") and node.args:
            target = self._dotted(node.args[0])
            if node.func.id != "getattr" and target is not None:
                self._check_assign(target + ".?", node)
            name = node.args[1] if len(node.args) > 1 else None
            if not isinstance(name, ast.Constant):
                self._hit(self._rule("dynamic_attribute"), node, f"{node.func.id}(…, <computed name>)")
            elif target is not None:
                self._check_names(f"{target}.{name.value}", node)
        self.generic_visit(node)

    def _check_assign(self, full: str, node: ast.AST) -> None:
        for rule in self.rules:
            if _under(full.split(".")[0], rule.assign_to) and "." in full:
                self._hit(rule, node, f"assigns {full}")

    def _rule(self, rule_id: str) -> Rule:
        return next(r for r in self.rules if r.id == rule_id)


def screen(source: str, rules: tuple[Rule, ...] | None = None, dtype: str = "bf16") -> Screening:
    """Findings for `source` (which must parse: syntax errors are the load gate's), for a target
    of `dtype`: the precision it asks for (ASKED) is not flagged."""
    scanner = _Scanner(rules or load_rules())
    scanner.visit(ast.parse(source))
    asked = ASKED.get(dtype, ())
    findings = [f for f in scanner.findings if not (f.rule == "reduced_precision" and f.what in asked)]
    streams = [f for f in findings if f.rule == "side_stream"]
    if streams and not (_JOINS & scanner.attr_calls):
        # A stream that is never waited on: whatever runs on it finishes after the timer stops.
        first = streams[0]
        findings.append(Finding("unjoined_stream", REJECT, first.line, first.what,
                                "launches on a side stream that is never joined back (no wait_stream, "
                                "wait_event or synchronize): that work would finish after the timer stops"))
    return Screening(_dedupe(findings))


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if (f.rule, f.line, f.what) not in seen:
            seen.add((f.rule, f.line, f.what))
            out.append(f)
    return out
