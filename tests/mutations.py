"""`python tests/mutations.py` (`make mutations`): every defence listed in tests/mutations.toml is
removed, one at a time, in a copy of the repository, and the tests the entry names must fail.

Each entry says what the defence is, where it lives (a file and an exact piece of its text), what
that text becomes without it, and the pytest ids that must catch its removal. For each, the
repository's files (as git lists them) are copied to a temporary folder, the text is replaced
there, and pytest runs the named tests in that copy, stopping at the first failure; entries run
side by side (`--jobs`). The table on stdout says, per defence, the test that failed — with the
first line of what it said — or SURVIVED. Exit 0 when every removal was caught, 1 when one survived
or its run broke, 2 before anything runs when an entry no longer fits the source (its text is gone
or found twice, its file or one of its tests no longer exists): the list cannot rot silently.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = Path(__file__).with_name("mutations.toml")
FIELDS = {"defence": str, "file": str, "old": str, "new": str, "tests": list}


@dataclass(frozen=True)
class Mutation:
    defence: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]

    def change(self) -> tuple[int, str, str]:
        """The first line the mutation changes: its index in the old text, and that line before
        and after (stripped; "" where one side has no such line)."""
        old, new = self.old.split("\n"), self.new.split("\n")
        i = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        return i, (old[i].strip() if i < len(old) else ""), (new[i].strip() if i < len(new) else "")

    def where(self, root: Path) -> str:
        """`file:line` of the first line the mutation changes."""
        text = (root / self.file).read_text()
        first = text[:text.index(self.old)].count("\n") + 1
        return f"{self.file}:{first + self.change()[0]}"


@dataclass(frozen=True)
class Outcome:
    mutation: Mutation
    where: str
    caught_by: str = ""  # the first named test that failed; "" when none did
    said: str = ""  # that test's failure, first line; or why the run broke
    broken: bool = False  # pytest itself did not run the tests through (not a verdict on the defence)


class Stale(Exception):
    """An entry that no longer fits the source or the tests: one line, naming it."""


def load(path: Path) -> list[Mutation]:
    try:
        entries = tomllib.loads(path.read_text()).get("mutation", [])
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise Stale(f"{path}: {e}") from None
    out = []
    for n, entry in enumerate(entries, 1):
        wrong = [k for k, kind in FIELDS.items() if not isinstance(entry.get(k), kind)] + sorted(set(entry) - set(FIELDS))
        if wrong or not entry["tests"] or not all(isinstance(t, str) for t in entry["tests"]):
            raise Stale(f"{path.name} entry {n}: needs {', '.join(FIELDS)} (tests: a non-empty list of pytest ids); "
                        f"wrong or unknown: {', '.join(wrong) or 'tests'}")
        out.append(Mutation(entry["defence"], entry["file"], entry["old"], entry["new"], tuple(entry["tests"])))
    return out


def check_texts(mutations: list[Mutation], root: Path, name: str) -> None:
    """Each entry's old text, once in its file, and a replacement that changes it."""
    for n, m in enumerate(mutations, 1):
        path = root / m.file
        count = path.read_text().count(m.old) if path.is_file() else -1
        if count != 1 or m.old == m.new:
            why = ("its file is gone" if count < 0 else "its old text is no longer in the file" if count == 0
                   else f"its old text is in the file {count} times" if count > 1 else "its new text is its old text")
            raise Stale(f"{name} entry {n} ({m.defence}): {m.file}: {why}")


def check_tests(mutations: list[Mutation], root: Path, name: str) -> None:
    """Every named pytest id is collected in the unmutated repository."""
    named = sorted({t for m in mutations for t in m.tests})
    files = sorted({t.split("::")[0] for t in named})
    for n, m in enumerate(mutations, 1):
        gone = [t for t in m.tests if not (root / t.split("::")[0]).is_file()]
        if gone:
            raise Stale(f"{name} entry {n} ({m.defence}): no test file {gone[0].split('::')[0]}")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *files], cwd=root, env=_env(root), capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        raise Stale(f"{name}: collecting its tests failed (pytest exited {done.returncode}): {said[0]}")
    collected = set(done.stdout.splitlines())
    for n, m in enumerate(mutations, 1):
        missing = [t for t in m.tests if t not in collected]
        if missing:
            raise Stale(f"{name} entry {n} ({m.defence}): no test {missing[0]}")


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}


def repository_files(root: Path) -> list[str]:
    """The files git lists (tracked, and new ones it does not ignore): no venv, no caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError) as e:
        raise Stale(f"{root} is not a git checkout, whose files the copies are made of ({e})") from None
    return [rel for rel in listed if (root / rel).is_file()]  # a deletion not yet staged is still listed


def run_one(m: Mutation, root: Path, files: list[str]) -> Outcome:
    where = m.where(root)
    with tempfile.TemporaryDirectory(prefix="infersmith-mutation-") as tmp:
        copy = Path(tmp) / "repo"
        for rel in files:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, copy / rel)
        path = copy / m.file
        path.write_text(path.read_text().replace(m.old, m.new, 1))
        report = Path(tmp) / "report.xml"
        # --gauntlet-all: a named gauntlet case runs even where CI's own run leaves it out (ci = false)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "--gauntlet-all", f"--junitxml={report}", *m.tests], cwd=copy, env=_env(copy),
                              capture_output=True, text=True)
        if done.returncode == 0:
            return Outcome(m, where)
        failed = _first_failure(report, m.tests) if report.exists() else None
        if done.returncode == 1 and failed:
            return Outcome(m, where, *failed)
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        return Outcome(m, where, "", f"pytest exited {done.returncode}: {tail[0]}", broken=True)


def _first_failure(report: Path, tests: tuple[str, ...]) -> tuple[str, str] | None:
    """(pytest id, first line of its failure) of the first named test that failed or errored."""
    ids = {_junit_key(t): t for t in tests}
    for case in ET.parse(report).iter("testcase"):
        for bad in (*case.iter("failure"), *case.iter("error")):
            said = (bad.get("message") or bad.text or "").strip().splitlines() or [""]
            if said[0].endswith(("{", "[", "(")):  # a dumped structure: its `assert` line says more
                report = [line.lstrip("E").strip() for line in (bad.text or "").splitlines()]  # the message may be cut
                said = [line for line in [*said, *report] if line.startswith("assert ")] or said
            return ids.get((case.get("classname"), case.get("name")), case.get("name")), said[0]
    return None


def _junit_key(test_id: str) -> tuple[str, str]:
    """pytest id -> (classname, name) as --junitxml writes them."""
    path, *scopes, name = test_id.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *scopes]), name


def table(outcomes: list[Outcome]) -> str:
    def cell(text: str, limit: int = 110) -> str:
        text = text if len(text) <= limit else text[:limit - 1] + "…"
        return text.replace("|", "\\|")

    def code(line: str) -> str:
        return f"`{cell(line, 60)}`" if line else "(nothing)"

    rows = ["| defence | mutation | caught by | what it said |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        m, (_, before, after) = o.mutation, o.mutation.change()
        caught = f"`{cell(o.caught_by, 1000)}`" if o.caught_by else "**BROKEN RUN**" if o.broken else "**SURVIVED**"
        rows.append(f"| {cell(m.defence)} | {o.where} {code(before)} → {code(after)} | {caught} | {cell(o.said)} |")
    survived = sum(not o.caught_by for o in outcomes)
    rows.append(f"\n{len(outcomes) - survived} of {len(outcomes)} removals caught"
                + (f"; {survived} not: the command fails" if survived else ""))
    return "\n".join(rows)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(prog="python tests/mutations.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", type=Path, default=LIST, help="the mutations (TOML; default: tests/mutations.toml)")
    parser.add_argument("--jobs", type=int, default=2, help="entries run side by side (default 2)")
    parser.add_argument("-k", dest="match", action="append", default=[],
                        help="only the entries whose defence or file contains this (repeatable: any of them)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.exit(2, "mutations: --jobs must be at least 1\n")
    try:
        mutations = [m for m in load(args.list)
                     if not args.match or any(k in m.defence or k in m.file for k in args.match)]
        if not mutations:
            raise Stale(f"{args.list.name}: no entry" + (f" matches {' or '.join(map(repr, args.match))}"
                                                          if args.match else ""))
        check_texts(mutations, root, args.list.name)
        check_tests(mutations, root, args.list.name)
        files = repository_files(root)
    except Stale as e:
        print(f"mutations: {e}", file=sys.stderr)
        return 2
    print(f"{len(mutations)} removals, {args.jobs} at a time", file=sys.stderr)

    def run(m: Mutation) -> Outcome:
        o = run_one(m, root, files)
        print(f"  {'caught' if o.caught_by else 'BROKEN' if o.broken else 'SURVIVED'}: {m.defence}", file=sys.stderr)
        return o

    with ThreadPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(run, mutations))
    print(table(outcomes))
    return 0 if all(o.caught_by for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
