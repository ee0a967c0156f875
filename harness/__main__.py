"""`python -m harness JOB.json --out VERDICT.json`: run one stage of one candidate.

This process is the supervisor (harness/supervisor.py); the candidate runs in a sandbox
process it starts. The controller runs this under a time limit; if it dies or is killed,
the controller records a `crash`. Anything that goes wrong inside is recorded in the
verdict, never swallowed.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from contract.job import Job
from contract.verdict import Verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    parser.add_argument("job", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    job = Job.from_json(args.job.read_text())
    scratch = args.job.resolve().parent
    out = args.out.resolve()
    try:
        from harness.supervisor import supervise

        verdict = supervise(job, scratch)
    except Exception:
        verdict = Verdict(op=job.candidate.op, candidate_id=job.candidate.id, stages=[job.stage])
        verdict.crash("harness", traceback.format_exc(limit=-8))
    tmp = out.with_suffix(".tmp")  # written only now: the sandbox and all it started are dead
    tmp.write_text(verdict.to_json())
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
