"""Free kernels for the engine tests that show which kernel the model really calls.

Each is the op's eager baseline, written as a `free` candidate file that appends a byte to a
`<op>.calls` file beside it on every call (a count that a server or CLI subprocess leaves behind
too), and multiplies its first output by the module's SCALE (1.0: eager's answer unchanged).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

SOURCE = '''\
from pathlib import Path

from engine_templates.ops import OPS

SCALE = 1.0
_eager = OPS[{op!r}].eager
_calls = Path(__file__).with_suffix(".calls")


def {op}(*args):
    with _calls.open("a") as f:
        f.write(".")
    out = _eager(*args)
    if SCALE == 1.0:
        return out
    if isinstance(out, tuple):
        return (out[0] * SCALE, *out[1:])
    return out * SCALE
'''


def counting_kernels(folder: Path, ops) -> dict[str, dict[str, str]]:
    """Writes a counting kernel for each op into `folder`; returns the kernels-file entries naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = {}
    for op in ops:
        path = folder / f"{op}.py"
        path.write_text(SOURCE.format(op=op))
        entries[op] = {"impl": "free", "path": str(path)}
    return entries


def calls(folder: Path, op: str) -> int:
    """How often the counting kernel of `op` in `folder` has run, in any process."""
    file = folder / f"{op}.calls"
    return len(file.read_text()) if file.exists() else 0


def count_calls(kernels, op: str) -> Counter:
    """Counts the model's calls of a KernelSet's chosen kernel for `op`, which still does the work."""
    chosen, counter = getattr(kernels, op), Counter()

    def counted(*args):
        counter[op] += 1
        return chosen(*args)

    setattr(kernels, op, counted)
    return counter
