"""`infersmith engine ...`: the LLM engine's own commands (engine_templates/engine/cli.py)."""
from __future__ import annotations

from cli.args import Parser, UsageError


def cmd_engine(args) -> int:
    """`infersmith engine generate|serve` (engine_templates/engine/cli.py); a bad model
    directory or kernels file is a usage error."""
    from engine_templates.engine.config import EngineSetupError

    try:
        return args.engine_fn(args)
    except EngineSetupError as e:
        raise UsageError(str(e)) from None


def add_commands(sub) -> None:
    """engine generate|serve|serve-reference|bench|profile|random-checkpoint."""
    about = ("the LLM engine: generate, serve (an OpenAI-compatible API), serve-reference (HF transformers), "
             "bench, profile, random-checkpoint")
    en = sub.add_parser("engine", help=about, description=about[0].upper() + about[1:] + ".")
    from engine_templates.engine.cli import add_commands

    add_commands(en.add_subparsers(dest="engine_command", required=True, parser_class=Parser))
    en.set_defaults(fn=cmd_engine)
