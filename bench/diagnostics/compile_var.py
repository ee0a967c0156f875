"""Diagnostic (docs/BENCHMARKS.md): torch.compile's baseline of fused_add_rmsnorm
at qwen3-8b decode batches 8 and 32, built as the harness builds it, against the template's
default point, timed as the harness times (CUDA graph over rotated sets) and by CUPTI kernel
time. Run it in several processes, with Inductor's caches off, to see which kernel Inductor's
autotuner picks in each:

    for i in 1 2 3 4; do TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python3 bench/diagnostics/compile_var.py fresh$i; done

The argument is a tag printed at the start of each line.
"""
import sys

sys.path.insert(0, "bench")
import torch

if not torch.cuda.is_available():
    raise SystemExit("compile_var: needs a CUDA GPU")
from points_probe import kernel_us

from engine_templates.models import PRESETS
from engine_templates.ops import OPS
from engine_templates.ops.base import generator
from harness.stages import compile_baseline
from harness.timing import Method, median_us, rotation_count

op = OPS["fused_add_rmsnorm"]
tpl = next(iter(op.templates.values()))
fn = tpl.build(dict(tpl.default))
shapes = op.shapes(PRESETS["qwen3-8b"], [8, 32], [], [])
l2 = torch.cuda.get_device_properties(0).L2_cache_size
compiled = compile_baseline(op, len(shapes))
m = Method("cuda", 25.0, 100.0, graph=True)
for s in shapes:
    sets = [op.inputs(s, torch.bfloat16, "cuda", generator("cuda", i), "normal") for i in range(rotation_count(op.bytes(s, torch.bfloat16), l2))]
    compiled(*sets[0])
    r = {n: median_us(f, sets, m).us for n, f in (("eager", op.eager), ("compile", compiled), ("cand", fn))}
    k = {n: kernel_us(f, sets) for n, f in (("compile", compiled), ("cand", fn))}
    print(sys.argv[1] if len(sys.argv) > 1 else "-", s.label, " ".join(f"{n} {v:.2f}" for n, v in r.items()), "| kernels", k, flush=True)
