"""Correctness of one call, split across the two processes of a stage.

In the sandbox (`run_call`): the candidate runs on its arguments with uninitialized memory
NaN-poisoned (an unwritten output reads as NaN, not as what a previous call left there);
then the output's form (an exact torch.Tensor with its own contiguous storage, on the right
device, in the right dtype), the inputs (bit-identical to a private copy), and threads (none
still running after the call returns).

In the supervisor (`judge`): the output's values against the float64 oracle, computed in a
process the candidate never ran in, from inputs redrawn there from the same seed; finiteness and
the comparison on the oracle's device, read back once per output.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from harness.device import synchronize


@dataclass
class CallResult:
    ok: bool
    gate: str  # the gate this call failed, or "" when it passed
    detail: str
    rel_error: float = 0.0
    outputs: tuple[torch.Tensor, ...] = field(default=(), repr=False)


@contextmanager
def poisoned_allocations():
    """torch.empty & co. return NaN-filled memory inside this block."""
    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(det, warn_only=det_warn)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return _relative(*_measure(out, ref)[1:])


def _measure(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, float, float]:
    """(elements of `out` not finite, ||ref||, ||out - ref||), computed in float64 where `ref` is
    (the oracle's device) and read back together: one synchronization per output."""
    out = out.to(ref.device)
    ref = ref.to(torch.float64)
    figures = torch.stack([(~torch.isfinite(out)).sum().to(torch.float64), ref.norm(),
                           (out.to(torch.float64) - ref).norm()])
    n_bad, denom, diff = figures.tolist()
    return int(n_bad), denom, diff


def _relative(denom: float, diff: float) -> float:
    return diff / denom if denom > 0 else diff


def run_call(op, fn, args: tuple, out_dtype: torch.dtype, device: str, poison: bool = True) -> CallResult:
    """Sandbox side: call once and check everything but the values. `poison=False` calls in the
    process's plain state, the one the bench stage times in (its outputs are judged in that state)."""
    private = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    threads_before = set(threading.enumerate())
    with poisoned_allocations() if poison else nullcontext():
        out = fn(*args)
    synchronize(device)
    left_running = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    if left_running:
        return CallResult(False, "hidden_work", f"{len(left_running)} thread(s) started by the call still run "
                                                f"after it returned ({', '.join(left_running[:3])}): work the "
                                                "timer would not see")
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != op.n_outputs:
        return CallResult(False, "output_form", f"returned {len(outs)} outputs, expected {op.n_outputs}")
    for i, o in enumerate(outs):
        where = f"output {i}" if op.n_outputs > 1 else "output"
        if type(o) is not torch.Tensor:
            return CallResult(False, "output_form", f"{where} is {type(o).__name__}, not a plain torch.Tensor "
                                                    "(a subclass or lazy object could compute when inspected)")
        if o.dtype != out_dtype or o.device.type != device:
            return CallResult(False, "output_form", f"{where} is {o.dtype} on {o.device.type}; "
                                                    f"expected {out_dtype} on {device}")
        if not o.is_contiguous():
            return CallResult(False, "output_form", f"{where} is not contiguous")
        for a in args:
            if isinstance(a, torch.Tensor) and o.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
                return CallResult(False, "output_form", f"{where} shares storage with an input (a view, "
                                                        "not a result)")
    for i, (a, p) in enumerate(zip(args, private)):
        if isinstance(a, torch.Tensor) and not torch.equal(a, p):
            return CallResult(False, "inputs_unchanged", f"argument {i} ({op.arg_names[i]}) was modified "
                                                         "by the candidate")
    return CallResult(True, "", "", outputs=tuple(outs))


def judge(op, outs: list[torch.Tensor], args: tuple, rtol: float) -> CallResult:
    """Supervisor side: the received outputs against the oracle on `args` (this process's own draw)."""
    refs = op.reference(*args)
    refs = refs if isinstance(refs, tuple) else (refs,)
    if len(outs) != len(refs):
        return CallResult(False, "output_form", f"sent {len(outs)} outputs, expected {len(refs)}")
    worst = 0.0
    for i, (o, r) in enumerate(zip(outs, refs)):
        where = f"output {i}" if len(refs) > 1 else "output"
        if tuple(o.shape) != tuple(r.shape):
            return CallResult(False, "output_form", f"{where} has shape {tuple(o.shape)}; expected {tuple(r.shape)}")
        n_bad, denom, diff = _measure(o, r)
        if n_bad:
            return CallResult(False, "finite", f"{where} has {n_bad} of {o.numel()} elements NaN or Inf "
                                               "(unwritten output reads as NaN)")
        err = _relative(denom, diff)
        worst = max(worst, err)
        if err > rtol:
            return CallResult(False, "accuracy", f"{where} relative error {err:.3g} > tolerance {rtol:g}", err)
    return CallResult(True, "", "", worst)


def check_call(op, fn, args: tuple, out_dtype: torch.dtype, device: str, rtol: float,
               oracle_args: tuple | None = None) -> CallResult:
    """Both halves in one process, on a private copy of the inputs: for op tests and op
    development, where the candidate is trusted. Stages never use it. Judged by `op`'s reference
    on `args`, or with `oracle_args` (the same draw by `op.oracle`) as the stages judge: for an
    fp8 target, against the full-precision op on the weights before quantization."""
    private = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    result = run_call(op, fn, args, out_dtype, device)
    if not result.ok:
        return result
    if oracle_args is not None:
        return judge(op.oracle, list(result.outputs), oracle_args, rtol)
    return judge(op, list(result.outputs), private, rtol)
