"""Knowledge entries: one markdown file with YAML front matter each, under <home>/knowledge.

The front matter is the entry as tools read it; the body is its text for a person, and what a
prompt shows. States: draft (derived from verified runs at the end of an optimization) ->
published (by a person) -> retired. Files are written whole and renamed into place, so a
reader never sees half an entry and a reviewer can diff them in a repository.
"""
from __future__ import annotations

import difflib
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import yaml

from tracking.errors import KnowledgeError
from tracking.store import home

DRAFT, PUBLISHED, RETIRED = "draft", "published", "retired"
STATES = (DRAFT, PUBLISHED, RETIRED)
MOVES = {PUBLISHED: (DRAFT,), RETIRED: (DRAFT, PUBLISHED)}  # to a state: from which states


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a free kernel's source) as literal blocks: a reviewer reads the code as code."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Entry:
    """The winning idea for one op, shape class and GPU class on one target, and what failed."""

    op: str
    shape_class: str  # the shape labels' prefix: decode, prefill, chunk
    gpu_class: str
    target: str  # the target key the runs were measured on
    model: str
    dtype: str
    shapes: list[str]
    winner: dict  # candidate_id, kind, template, point, source_sha256, proposer, summary, run_id, source
    score: float  # geometric-mean speed-up over the best baseline on these shapes
    vs_compile: float | None  # ... over torch.compile (None: not timed against it, as on a CPU)
    vs_eager: float | None
    gpu_timing: bool
    device: str
    failures: dict[str, int]  # failing gate -> candidates it stopped, over every verified run
    runs: list[str]  # the verified MLflow runs it was derived from
    id: str = ""
    state: str = DRAFT
    history: list[dict] = field(default_factory=list)  # {state, at, by, note}
    body: str = ""

    @property
    def subject(self) -> tuple[str, str, str, str]:
        """What one entry at a time is published about."""
        return self.op, self.shape_class, self.gpu_class, self.target

    @property
    def prefix(self) -> str:
        return f"{self.op}-{self.shape_class}-{self.gpu_class}-{self.model}-{self.dtype}"

    @property
    def revision(self) -> int:
        return int(self.id.rsplit("-", 1)[1])

    def text(self) -> str:
        meta = {k: v for k, v in asdict(self).items() if k != "body"}
        return f"---\n{yaml.dump(meta, Dumper=_Dumper, sort_keys=False, allow_unicode=True)}---\n{self.body}"

    @classmethod
    def parse(cls, text: str, where: str) -> Entry:
        lines = text.split("\n")
        end = next((i for i, line in enumerate(lines[1:], 1) if line == "---"), None)
        if lines[0] != "---" or end is None:
            raise KnowledgeError(f"{where}: no YAML front matter between --- lines")
        try:
            meta = yaml.safe_load("\n".join(lines[1:end])) or {}
        except yaml.YAMLError as e:
            raise KnowledgeError(f"{where}: front matter is not YAML ({str(e).splitlines()[0]})") from None
        known = {f.name for f in fields(cls)} - {"body"}
        if not isinstance(meta, dict) or set(meta) - known or meta.get("state") not in STATES:
            raise KnowledgeError(f"{where}: front matter is not a knowledge entry")
        try:
            return cls(**meta, body="\n".join(lines[end + 1:]))
        except TypeError as e:  # a field missing
            raise KnowledgeError(f"{where}: {e}") from None


class KnowledgeBase:
    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def from_env(cls) -> KnowledgeBase:
        return cls(home() / "knowledge")

    def entries(self, state: str | None = None, op: str | None = None) -> list[Entry]:
        if not self.root.is_dir():
            return []
        out = [Entry.parse(p.read_text(), str(p)) for p in sorted(self.root.glob("*.md"))]
        return [e for e in out if (state is None or e.state == state) and (op is None or e.op == op)]

    def get(self, entry_id: str) -> Entry:
        path = self.root / f"{entry_id}.md"
        if "/" in entry_id or not path.is_file():
            ids = [p.stem for p in self.root.glob("*.md")] if self.root.is_dir() else []
            near = difflib.get_close_matches(entry_id, ids, n=3)
            raise KnowledgeError(f"no knowledge entry {entry_id!r}"
                                 + (f"; did you mean {', '.join(near)}?" if near else "; `infersmith kb list` shows them"))
        return Entry.parse(path.read_text(), str(path))

    def _written(self, entry: Entry) -> str:
        """The entry in a temporary file beside the others (not *.md, so no reader lists it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".part")
        with os.fdopen(fd, "w") as f:
            f.write(entry.text())
        return tmp

    def save(self, entry: Entry) -> None:
        os.replace(self._written(entry), self.root / f"{entry.id}.md")

    def add(self, entry: Entry) -> Entry:
        """Give a new entry the next free revision of its prefix, and write it."""
        pattern = re.compile(re.escape(entry.prefix) + r"-(\d+)\.md$")
        rev = max((int(m[1]) for p in self.root.glob("*.md") if (m := pattern.match(p.name))), default=0)
        while True:
            rev += 1
            entry.id = f"{entry.prefix}-{rev}"
            tmp = self._written(entry)
            try:  # a hard link is made whole or not at all, and never over another flow's revision
                os.link(tmp, self.root / f"{entry.id}.md")
                return entry
            except FileExistsError:
                continue
            finally:
                os.unlink(tmp)

    def move(self, entry_id: str, state: str, by: str, note: str = "") -> list[Entry]:
        """Publish or retire an entry; publishing retires the entry published before on its subject.
        Returns the entries changed, this one first."""
        entry = self.get(entry_id)
        if entry.state not in MOVES[state]:
            raise KnowledgeError(f"{entry_id} is {entry.state}: only a {' or '.join(MOVES[state])} entry can be {state}")
        changed = [entry]
        if state == PUBLISHED:
            changed += [e for e in self.entries(PUBLISHED, entry.op) if e.subject == entry.subject]
        for e in changed:
            e.state = state if e is entry else RETIRED
            e.history.append({"state": e.state, "at": now(), "by": by,
                              "note": note if e is entry else f"superseded by {entry.id}"})
            self.save(e)
        return changed

    def export(self, dest: Path, states: tuple[str, ...] = (PUBLISHED,)) -> list[Path]:
        """Copy the entries in `states` into dest (a repository's folder), as they are."""
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for e in self.entries():
            if e.state in states:
                out.append(Path(shutil.copy2(self.root / f"{e.id}.md", dest / f"{e.id}.md")))
        return out
