"""Diagnostic (docs/BENCHMARKS.md): print a bench job for `python -m harness`,
the op's template default at the preset's prefill shapes, so that one stage can be run through
supervisor and sandbox without a flow:

    python3 bench/diagnostics/bench_job.py rmsnorm [qwen3-8b] > job.json
    python3 -m harness job.json --out verdict.json

An unknown op or preset is refused.
"""
import sys

from contract.job import Candidate, Job
from engine_templates.models import PRESETS
from engine_templates.ops import OPS

if len(sys.argv) < 2 or sys.argv[1] not in OPS:
    raise SystemExit(f"bench_job: name an op: {', '.join(OPS)}")
preset = sys.argv[2] if len(sys.argv) > 2 else "qwen3-8b"
if preset not in PRESETS:
    raise SystemExit(f"bench_job: no preset {preset!r}; the presets are {', '.join(PRESETS)}")
op = OPS[sys.argv[1]]
tpl = next(iter(op.templates.values()))
shapes = op.shapes(PRESETS[preset], [], [2048, 16384], [])
cand = Candidate(op=op.name, kind="template", template=tpl.name, point=dict(tpl.default))
print(Job(stage="bench", candidate=cand, model=preset, shapes=shapes, odd_shapes=[], device="cuda").to_json())
