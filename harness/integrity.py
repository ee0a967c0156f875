"""What the candidate must leave as it found it: the timers and checks in memory, and the
harness's files on disk.

`Identities` is taken inside the sandbox before the candidate is imported and compared
after every shape's timings in the bench stage and at the end of every stage: a candidate that
swaps `time.perf_counter`, `torch.cuda.Event` or a harness function is rejected even if the
swap was hidden from static screening, and even if it undoes the swap when it is probed rather
than timed. (harness/timing.py binds its timers and reductions at import, so such a swap cannot
steer a measurement before it is caught.) `tree_digest` is taken by the supervisor before the sandbox starts
and after it ends.
"""
from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path

# (module, attribute path) whose object must be the same after the candidate ran.
WATCHED = [
    ("time", "perf_counter"), ("time", "perf_counter_ns"), ("time", "monotonic"), ("time", "time"),
    ("time", "sleep"), ("torch", "cuda.synchronize"), ("torch", "cuda.Event"), ("torch", "cuda.Event.record"),
    ("torch", "cuda.Event.elapsed_time"), ("torch", "cuda.Event.synchronize"), ("torch", "cuda.Stream"),
    ("torch", "cuda.current_stream"), ("torch", "cuda.graph"), ("torch", "cuda.CUDAGraph"),
    ("torch", "cuda.CUDAGraph.replay"), ("torch", "cuda.set_per_process_memory_fraction"),
    ("torch", "equal"), ("torch", "isfinite"), ("torch", "Tensor.clone"), ("torch", "Tensor.copy_"),
    ("torch", "Tensor.data_ptr"), ("torch", "Tensor.untyped_storage"), ("torch", "Tensor.is_contiguous"),
    ("torch", "use_deterministic_algorithms"), ("torch", "utils.deterministic"), ("threading", "enumerate"),
    ("statistics", "median"), ("triton.testing", "do_bench"), ("os", "write"), ("os", "urandom"),
    ("random", "_urandom"), ("builtins", "len"), ("builtins", "sorted"), ("builtins", "min"), ("builtins", "max"),
    ("builtins", "sum"), ("builtins", "zip"), ("builtins", "range"), ("builtins", "int"), ("builtins", "float"),
    ("builtins", "isinstance"), ("builtins", "getattr"),
    # What torch's own timing functions look up when called (torch.cuda.current_stream,
    # synchronize, CUDAGraph): a swap there would move the events to another stream. Absent from
    # a CPU build's torch._C, and skipped there.
    ("torch", "_C._cuda_synchronize"), ("torch", "_C._cuda_getCurrentStream"), ("torch", "cuda._lazy_init"),
    ("torch", "cuda.device"), ("torch", "cuda._get_device_index"), ("torch", "cuda.graphs.CUDAGraph"),
]
HARNESS_MODULES = ("harness.checks", "harness.timing", "harness.timed_outputs", "harness.stages", "harness.channel", "harness.device",
                   "harness.integrity", "harness.load", "harness.sandbox", "contract.verdict")


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class Identities:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], object] = {}
        for module, path in WATCHED:
            try:
                self.objects[module, path] = _resolve(module, path)
            except (ImportError, AttributeError):
                continue  # not in this torch/triton build: nothing to patch either
        for name in HARNESS_MODULES:
            mod = sys.modules.get(name)
            for attr, value in vars(mod).items() if mod else ():
                if callable(value) and not attr.startswith("__"):
                    self.objects[name, attr] = value

    def changed(self) -> list[str]:
        """Names now bound to a different object than when the snapshot was taken."""
        out = []
        for (module, path), obj in self.objects.items():
            try:
                now = _resolve(module, path)
            except (ImportError, AttributeError):
                now = None
            if now is not obj:
                out.append(f"{module}.{path}")
        return out


def swapped_detail(names: list[str]) -> str:
    return f"the candidate replaced {', '.join(names[:6])}: timers and checks must stay the harness's"


def tree_digest(roots: list[Path]) -> dict[str, str]:
    """sha256 and modification time of every file under `roots`, __pycache__ included (a planted
    .pyc is a patched copy). The time catches a write that left the bytes as they were: the
    candidate wrote into the harness, whatever it wrote."""
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                out[str(path)] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {path.stat().st_mtime_ns}"
    return out


def tree_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    added = [f"added {p}" for p in after if p not in before]
    removed = [f"removed {p}" for p in before if p not in after]
    changed = [f"changed {p}" for p in before if p in after and before[p] != after[p]]
    return added + removed + changed
