"""Diagnostic (docs/BENCHMARKS.md): silu_mul at qwen3-30b-a3b, the harness's
bench stage run in this process (no supervisor, no sandbox) against the probes' way of timing.

Usage (a GPU host, repo root):
    python3 bench/diagnostics/stage_vs_probe.py MODE [short] [fraction] [netns]
MODE: "stage" (the bench stage alone), "stage-first" / "probe-first" (the stage and two probe
passes, in that order), "job" (print the bench job as JSON, for `python -m harness JOB --out V`).
short: decode batches 8, 32, 128 only (default 1, 8, 32, 128 and prefill 2048, 16384);
fraction: torch's per-process memory fraction 0.8, as the sandbox sets it; netns: the sandbox's
limits (core dumps, an own network namespace) first.
"""
import sys

sys.path.insert(0, "bench")
import torch
from points_probe import kernel_us

from contract.job import Candidate, Job
from engine_templates.models import PRESETS
from engine_templates.ops.base import generator
from engine_templates.ops.silu_mul import FLAT_TEMPLATE, OP
from harness import stages
from harness.baselines import measure_all
from harness.plan import fresh_seeds
from harness.timing import Method, by_graph, median_us, rotation_count

order = sys.argv[1] if len(sys.argv) > 1 else ""
if order not in ("stage", "stage-first", "probe-first", "job"):
    raise SystemExit("stage_vs_probe: MODE is one of stage, stage-first, probe-first, job")
if "netns" in sys.argv:
    from harness import limits
    print(limits.cap_memory(16384, False), limits.drop_network(False))
preset = PRESETS["qwen3-30b-a3b"]
shapes = OP.shapes(preset, [8, 32, 128], [], []) if "short" in sys.argv else OP.shapes(preset, [1, 8, 32, 128], [2048, 16384], [])
bf = torch.bfloat16
cand = Candidate(op="silu_mul", kind="template", template="flat", point=dict(FLAT_TEMPLATE.default))
job = Job(stage="bench", candidate=cand, model="qwen3-30b-a3b", shapes=shapes, odd_shapes=[], device="cuda")
if order == "job":
    print(job.to_json())
    sys.exit(0)
if not torch.cuda.is_available():
    raise SystemExit("stage_vs_probe: needs a CUDA GPU")
l2 = torch.cuda.get_device_properties(0).L2_cache_size
if "fraction" in sys.argv:
    torch.cuda.set_per_process_memory_fraction(0.8)
fn = FLAT_TEMPLATE.build(dict(FLAT_TEMPLATE.default))
# The plan as harness.plan.bench_plan makes it, with the H200's measured copy rate
# (4.25 TB/s, ../shared/ANCHORS.md) for the ceiling the supervisor would measure.
COPY_BYTES_PER_US = 4.25e6
counts = [rotation_count(OP.bytes(s, bf), l2) for s in shapes]
plan = {"shapes": [{"shape": s.label, "sets": fresh_seeds(n), "refill": fresh_seeds(n),
                    "graph": by_graph("cuda", OP.bytes(s, bf) / COPY_BYTES_PER_US, job.rules.launch_bound_us)}
                   for s, n in zip(shapes, counts)]}


def send(kind, *a, **kw):
    if kind == "timing":
        print(f"stage {kw['label']:14s} cand {kw['candidate_us']:7.2f} rep {kw['candidate_us_repeat']:7.2f} "
              f"sets {kw['sets']} {kw['method']}", flush=True)
    elif kind == "gate":
        print("stage gate", kw, flush=True)


def probe(tag, rep_ms, use_plan_seeds):
    compiled = stages.compile_baseline(OP, len(shapes))
    method = Method("cuda", 25.0, rep_ms, graph=True)
    for s, item in zip(shapes, plan["shapes"]):
        if not s.label.startswith("decode"):
            continue
        seeds = item["sets"] if use_plan_seeds else range(len(item["sets"]))
        arg_sets = [OP.inputs(s, bf, "cuda", generator("cuda", x), "normal") for x in seeds]
        r = {}
        for name, f in (("eager", OP.eager), ("compile", compiled), ("cand", fn), ("cand2", fn)):
            if name == "compile":
                f(*arg_sets[0])
            r[name] = median_us(f, arg_sets, method).us
        print(f"{tag:22s} {s.label:14s} " + " ".join(f"{k} {v:7.2f}" for k, v in r.items()), flush=True)
        if s.label in ("decode_b32", "decode_b128"):
            for name, f in (("eager", OP.eager), ("compile", compiled), ("cand", fn)):
                print(f"{tag:22s} {s.label:14s} kernel {name:8s} " + ", ".join(
                    f"{k} {us:.2f}" for k, us in kernel_us(f, arg_sets).items()), flush=True)


def stage():
    """The bench stage as the sandbox runs it: the baselines first, then the candidate."""
    base = measure_all(job, OP, "cuda", plan, send, lambda: True)
    for label, (eager, comp) in base.items():
        print(f"stage {label:14s} eager {eager.us:7.2f} compile {comp.us:7.2f}", flush=True)
    stages.bench_stage(job, OP, fn, "cuda", plan, send, base)


if order == "stage":
    stage()
elif order == "stage-first":
    stage()
    probe("probe(plan seeds,100)", 100.0, True)
    probe("probe(0..n,200)", 200.0, False)
else:
    probe("probe(0..n,200)", 200.0, False)
    probe("probe(plan seeds,100)", 100.0, True)
    stage()
