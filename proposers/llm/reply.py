"""The module a reply holds: its fenced Python block, or the reply itself when it is bare code.

Whether that module is any good is the gates' to say (a syntax error fails `load`, a missing
function `signature`); only a reply that holds no code at all is not a module.
"""
from __future__ import annotations

import re

# A fence opened as ```python, ```py or bare ```, closed by ``` on its own line or left open
# (a reply cut off at the output-token limit).
FENCE = re.compile(r"^```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:^```[ \t]*$|\Z)", re.S | re.M)


def defines(code: str, name: str) -> bool:
    return re.search(rf"^(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def extract_module(text: str, op: str) -> str | None:
    """The module in `text` for op `op`, or None when the reply holds no code."""
    blocks = [b for b in (m.group(1).strip("\n") for m in FENCE.finditer(text)) if b.strip()]
    # The last block that defines the op's function: a reply may quote the old code first.
    for block in reversed(blocks):
        if defines(block, op):
            return block + "\n"
    if blocks:
        return max(blocks, key=len) + "\n"
    if defines(text, op):
        return text.strip("\n") + "\n"
    return None
