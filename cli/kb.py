"""`infersmith kb list|show|publish|retire|export`: the knowledge base a person reviews. An
optimization writes draft entries; only a published one reaches a prompt or a warm start."""
from __future__ import annotations

import getpass
from pathlib import Path

from cli.args import Parser, UsageError


def _kb():
    from tracking.knowledge import KnowledgeBase

    return KnowledgeBase.from_env()


def _speed(x: float | None) -> str:
    return f"{x:.2f}x" if x else "-"


def cmd_list(args) -> int:
    entries = _kb().entries(args.state, args.op)
    if not entries:
        print("no knowledge entries" + (f" of {args.op}" if args.op else "") + (f" {args.state}" if args.state else ""))
        return 0
    print(f"{'id':<44}  {'state':<9}  {'score':>6}  {'vs compile':>10}  winner")
    for e in entries:
        w = e.winner
        idea = (f"{w['template']}[{','.join(f'{k}={v}' for k, v in sorted(w['point'].items()))}]"
                if w["kind"] == "template" else f"free:{w['source_sha256'][:8]}")
        print(f"{e.id:<44}  {e.state:<9}  {_speed(e.score):>6}  {_speed(e.vs_compile):>10}  {idea}  [{e.target}]")
    return 0


def cmd_show(args) -> int:
    print(_kb().get(args.id).text(), end="")
    return 0


def _move(args, state: str) -> int:
    changed = _kb().move(args.id, state, args.by, args.note)
    print(f"{changed[0].id}: {state} by {args.by}")
    for e in changed[1:]:
        print(f"{e.id}: retired (superseded by {changed[0].id})")
    return 0


def cmd_publish(args) -> int:
    return _move(args, "published")


def cmd_retire(args) -> int:
    return _move(args, "retired")


def cmd_export(args) -> int:
    from tracking.knowledge import STATES

    states = tuple(args.state or ["published"])
    unknown = sorted(set(states) - set(STATES))
    if unknown:
        raise UsageError(f"unknown state {', '.join(unknown)}; known: {', '.join(STATES)}")
    dest = Path(args.dir)
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest} is not a directory")
    written = _kb().export(dest, states)
    print(f"{len(written)} entries ({', '.join(states)}) written to {dest}")
    return 0


def _one_line(fn):
    """An entry file a person broke by hand, like a bad id, is one line and exit 2."""
    def run(args) -> int:
        from tracking.errors import KnowledgeError

        try:
            return fn(args)
        except KnowledgeError as e:
            raise UsageError(str(e)) from None
    return run


def add_commands(sub) -> None:
    kb = sub.add_parser("kb", help="the knowledge base: list, show, publish, retire, export entries")
    kb_sub = kb.add_subparsers(dest="kb_command", required=True, parser_class=Parser)
    ls = kb_sub.add_parser("list", help="entries, their state, score and winning idea")
    ls.add_argument("--op", help="only this op's entries")
    ls.add_argument("--state", choices=["draft", "published", "retired"], help="only entries in this state")
    ls.set_defaults(fn=_one_line(cmd_list))
    sh = kb_sub.add_parser("show", help="an entry's file: front matter and text")
    sh.add_argument("id")
    sh.set_defaults(fn=_one_line(cmd_show))
    for name, fn, what in (("publish", cmd_publish, "publish a draft: prompts and warm starts may use it; the "
                                                   "entry published before on its subject is retired"),
                           ("retire", cmd_retire, "retire a draft or published entry: nothing uses it any more")):
        c = kb_sub.add_parser(name, help=what)
        c.add_argument("id")
        c.add_argument("--by", default=getpass.getuser(), help="who decides (default: this user)")
        c.add_argument("--note", default="", help="why, kept in the entry's history")
        c.set_defaults(fn=_one_line(fn))
    ex = kb_sub.add_parser("export", help="copy entries into a directory (a repository's folder)")
    ex.add_argument("dir")
    ex.add_argument("--state", action="append", help="entries in this state (repeatable; default published)")
    ex.set_defaults(fn=_one_line(cmd_export))
