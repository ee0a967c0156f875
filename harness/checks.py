"""Correctness of one call: output form, finiteness, accuracy against the oracle, inputs intact.

The candidate runs on its arguments first; the float64 reference is computed afterwards,
from a private copy the candidate never saw, so there is nothing to read or to match.
Uninitialized memory is filled with NaN while checks run, so an output left unwritten
shows up as NaN instead of as whatever a previous call left there.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from harness.device import synchronize


@dataclass
class CallResult:
    ok: bool
    gate: str  # the gate this call failed, or "" when it passed
    detail: str
    rel_error: float = 0.0


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


def _tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.to(out.device, torch.float64)
    denom = ref.norm().item()
    diff = (out.to(torch.float64) - ref).norm().item()
    return diff / denom if denom > 0 else diff


def check_call(op, fn, args: tuple, out_dtype: torch.dtype, device: str, rtol: float) -> CallResult:
    private = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with poisoned_allocations():
        out = fn(*args)
    synchronize(device)
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != op.n_outputs:
        return CallResult(False, "output_form", f"returned {len(outs)} outputs, expected {op.n_outputs}")

    refs = op.reference(*private)
    refs = refs if isinstance(refs, tuple) else (refs,)
    worst = 0.0
    for i, (o, r) in enumerate(zip(outs, refs)):
        where = f"output {i}" if op.n_outputs > 1 else "output"
        if type(o) is not torch.Tensor:
            return CallResult(False, "output_form", f"{where} is {type(o).__name__}, not a plain torch.Tensor")
        if o.dtype != out_dtype or tuple(o.shape) != tuple(r.shape) or o.device.type != device:
            return CallResult(False, "output_form",
                              f"{where} is {o.dtype} {tuple(o.shape)} on {o.device.type}; "
                              f"expected {out_dtype} {tuple(r.shape)} on {device}")
        if not o.is_contiguous():
            return CallResult(False, "output_form", f"{where} is not contiguous")
        for a in _tensors(args):
            if o.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
                return CallResult(False, "output_form", f"{where} shares storage with an input")
        n_bad = (~torch.isfinite(o)).sum().item()
        if n_bad:
            return CallResult(False, "finite", f"{where} has {n_bad} of {o.numel()} elements NaN or Inf "
                                                "(unwritten output reads as NaN)")
        err = rel_error(o, r)
        worst = max(worst, err)
        if err > rtol:
            return CallResult(False, "accuracy", f"{where} relative error {err:.3g} > tolerance {rtol:g}", err)
    for i, (a, p) in enumerate(zip(args, private)):
        if isinstance(a, torch.Tensor) and not torch.equal(a, p):
            return CallResult(False, "inputs_unchanged", f"argument {i} was modified by the candidate", worst)
    return CallResult(True, "", "", worst)
