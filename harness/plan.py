"""What the supervisor asks of the sandbox, drawn before the sandbox sees it: the check stage's
calls (shape, input distribution, seed), and the bench stage's input sets per shape, how each
shape is timed (`timing.by_graph`), its roofline, and the baselines to measure or to check
(harness/baselines.py). Seeds come from the operating system's entropy, in this process."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from contract.job import Job
from engine_templates.ops.base import DISTRIBUTIONS, activation_dtype
from harness import baselines, timing
from harness import device as devices
from harness.stages import probed_sets

_seeds = random.SystemRandom()
LOW = (1 << 32) - 1


def check_plan(job: Job) -> dict:
    dists = itertools.cycle(DISTRIBUTIONS)
    shapes = [s for s in [*job.shapes, *job.odd_shapes] for _ in range(job.rules.seeds)]
    calls = [{"shape": s.label, "dist": next(dists), "seed": seed} for s, seed in zip(shapes, fresh_seeds(len(shapes)))]
    return {"calls": calls}


def fresh_seeds(n: int, taken: set[int] | None = None) -> list[int]:
    """`n` seeds whose low 32 bits differ from each other's and from those in `taken` (which gets
    theirs): a CPU generator seeds from those bits alone, and two seeds that share them draw the
    same values."""
    taken = set() if taken is None else taken
    out: list[int] = []
    while len(out) < n:
        seed = _seeds.getrandbits(62)
        if seed & LOW not in taken:
            taken.add(seed & LOW)
            out.append(seed)
    return out


def probe_items(spec: dict) -> set[str]:
    """The outputs the probes of one planned shape return, as `phase/set`: a timed and a refilled
    call on its first and its last input set."""
    return {f"{phase}/{j}" for phase in ("timed", "refill") for j in probed_sets(len(spec["sets"]))}


@dataclass
class BenchPlan:
    plan: dict  # what the sandbox gets
    roofline: dict[str, tuple[float, int, int]]  # per shape: roofline us, bytes, FLOPs
    key: dict  # how the baselines are measured here (baselines.key)
    book: baselines.Book


def bench_plan(job: Job, op, device: str, info: dict, sources: dict[str, str]) -> BenchPlan:
    """`info`: the device's description (harness.device.describe), given its ceilings here, before
    the candidate runs. `sources`: the worker's trees as the supervisor hashed them."""
    dtype = job.rules.dtype
    ceil, fresh = devices.ceilings_for(job, device, info)
    info["ceilings"] = ceil
    if device == "cuda" and fresh:
        torch.cuda.empty_cache()  # the measurement's buffers go back before the sandbox allocates
    l2 = info.get("l2_bytes", 0) if device == "cuda" else 0
    roofline, items, taken = {}, [], set()
    for shape in job.shapes:
        nbytes, flops = op.bytes(shape, activation_dtype(dtype)), op.flops(shape)
        roof = max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["matmul_flops_per_s"]) * 1e6
        roofline[shape.label] = (roof, nbytes, flops)
        n = timing.rotation_count(nbytes, l2) if device == "cuda" else 2
        items.append({"shape": shape.label, "sets": fresh_seeds(n, taken),
                      "refill": fresh_seeds(len(probed_sets(n)), taken),
                      "timed_refill": fresh_seeds(2, taken),  # one set refilled inside each candidate timing
                      "graph": timing.by_graph(device, roof, job.rules.launch_bound_us)})
    key = baselines.key(job, info, items, sources)
    section = baselines.plan(job, key)
    return BenchPlan({"shapes": items, "baselines": section}, roofline, key,
                     baselines.Book(section, [i["shape"] for i in items]))

