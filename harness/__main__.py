"""`python -m harness JOB.json --out VERDICT.json`: run one stage of one candidate.
`python -m harness session SESSION.json --channel FD`: run a candidate's stages in one sandbox,
one stage a request.

This process is the supervisor (harness/supervisor.py); the candidate runs in a sandbox
process it starts. The controller runs this under a time limit; if it dies or is killed,
the controller records a `crash`. Anything that goes wrong inside is recorded in the
verdict, never swallowed.

A session: SESSION.json holds the stages in order and each one's job, read before the sandbox
exists. FD is one end of a Unix socket pair whose other end only the controller holds (the sandbox
inherits neither; a socket, unlike a pipe, cannot be opened again through /proc). Each request is a
line on it naming the next stage, `{"stage": NAME}`; each reply is that stage's verdict, one line
of JSON. The session ends after its last stage, at the first stage that does not pass, or when
the requests end; the sandbox is dead before the last verdict is sent.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from contract.job import Job
from contract.verdict import Verdict


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["session"]:
        return session_main(argv[1:])
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
        verdict = _crashed(job)
    tmp = out.with_suffix(".tmp")  # written only now: the sandbox and all it started are dead
    tmp.write_text(verdict.to_json())
    tmp.replace(out)
    return 0


def session_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness session", description=__doc__)
    parser.add_argument("spec", type=Path)
    parser.add_argument("--channel", type=int, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    jobs = {stage: Job.from_json(text) for stage, text in spec["jobs"].items()}
    channel = socket.socket(fileno=args.channel)
    from harness.supervisor import Session

    session = Session(args.spec.resolve().parent, list(jobs), jobs.get("bench"))
    try:
        with channel.makefile("r", encoding="utf-8") as requests:
            for line in requests:
                stage = str(json.loads(line).get("stage"))
                job = jobs.get(stage) or replace(next(iter(jobs.values())), stage=stage)  # refused below
                try:
                    verdict = session.stage(job)
                except Exception:
                    verdict = _crashed(job)
                    session.close()
                if session.over:  # the sandbox and all it started are dead before the last verdict goes
                    session.close()
                channel.sendall((json.dumps(json.loads(verdict.to_json())) + "\n").encode())
                if session.over:
                    break
    finally:
        session.close()
        channel.close()
    return 0


def _crashed(job: Job) -> Verdict:
    verdict = Verdict(op=job.candidate.op, candidate_id=job.candidate.id, stages=[job.stage])
    verdict.crash("harness", traceback.format_exc(limit=-8))
    return verdict


if __name__ == "__main__":
    sys.exit(main())
