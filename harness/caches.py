"""Where a stage's compilers keep their caches: Triton's kernels and Inductor's graphs.

A compile cache is state that outlives a process: what one process writes there, a later one
loads. Each cache therefore has a scope, under INFERSMITH_CACHE (default ~/.cache/infersmith),
`compile/`, and a stage's sandbox is pointed at its scopes through the environment:
- `baselines`: torch.compile of the op's eager code, used only before a candidate is loaded;
- `template-<op>-<template>`: the template candidates of one template. Their code is the
  project's own (a point changes only its constants, and every point's kernels are cached under
  their own hash), so a point's compile stage warms its check and bench stages, and the
  launchers Triton builds for a template's kernels are built once;
- `free-<candidate id>`: one free candidate's, shared by its own stages only — a candidate whose
  source differs has another id. Removed a day after it was last used.
Before these scopes every stage shared Triton's and Inductor's default caches, where one free
candidate's files were another's to load. A free candidate can still write anywhere its user
may, these folders included, if it goes looking for them: the operating system does not keep
one user's processes out of each other's files.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from contract.job import Job

FREE_KEPT_S = 86400.0


def root() -> Path:
    return Path(os.environ.get("INFERSMITH_CACHE", Path.home() / ".cache" / "infersmith")) / "compile"


def scope(job: Job) -> str:
    c = job.candidate
    return f"template-{c.op}-{c.template}" if c.kind == "template" else f"free-{c.id}"


def env(name: str) -> dict[str, str]:
    """The environment that points Triton and Inductor at scope `name`'s folders."""
    base = root() / name
    (base / "triton").mkdir(parents=True, exist_ok=True)
    (base / "inductor").mkdir(parents=True, exist_ok=True)
    os.utime(base)  # last used now: see prune_free
    return {"TRITON_CACHE_DIR": str(base / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor")}


def for_stage(job: Job) -> dict[str, dict[str, str]]:
    """The sandbox's caches: `baselines` before the candidate loads (bench only), `candidate` after."""
    out = {"candidate": env(scope(job))}
    if job.stage == "bench":
        out["baselines"] = env("baselines")
    return out


def prune_free(now: float | None = None) -> None:
    """Free candidates' scopes not used for FREE_KEPT_S: their candidates were evaluated long ago."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(root()))
    except FileNotFoundError:
        return
    for entry in entries:
        try:
            stale = entry.name.startswith("free-") and now - entry.stat().st_mtime > FREE_KEPT_S
        except FileNotFoundError:
            continue  # removed by another stage meanwhile
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)
