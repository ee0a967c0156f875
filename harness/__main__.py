"""`python -m harness JOB.json --out VERDICT.json`: run one stage of one candidate.
`python -m harness session SESSION.json --channel FD` (or `--requests FD --replies FD`): run a
candidate's stages in one sandbox, one stage a request.

This process is the supervisor (harness/supervisor.py); the candidate runs in a sandbox
process it starts. The controller runs this under a time limit; if it dies or is killed,
the controller records a `crash`. Anything that goes wrong inside is recorded in the
verdict, never swallowed.

A session: SESSION.json holds the stages in order and each one's job, read before the sandbox
exists. The first line is `{"key": HEX}`, read before the sandbox exists; then each request is a
line naming the next stage, `{"stage": NAME}`; each reply is that stage's verdict, one line: the
HMAC-SHA256 of the verdict's JSON under the key (hex), a space, the JSON. They travel on FD `--channel`, one end of a Unix socket pair
whose other end only the controller holds (a socket, unlike a pipe, cannot be opened again
through /proc), or on two pipes, `--requests` and `--replies` (over SSH: the connection's). The
sandbox inherits none of them, and once it runs this process is not dumpable: no other process
of its user can open its descriptors through /proc. The session ends after its last stage, at
the first stage that does not pass, or when the requests end; the sandbox is dead before the
last verdict is sent.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
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
    parser.add_argument("--channel", type=int, help="a Unix socket: the requests, and the replies")
    parser.add_argument("--requests", type=int, help="the requests' pipe (with --replies, in place of --channel)")
    parser.add_argument("--replies", type=int)
    args = parser.parse_args(argv)
    if (args.channel is None) == (args.requests is None or args.replies is None):
        parser.error("give --channel, or --requests and --replies")
    spec = json.loads(args.spec.read_text())
    jobs = {stage: Job.from_json(text) for stage, text in spec["jobs"].items()}
    if args.channel is not None:
        channel = socket.socket(fileno=args.channel)
        requests, reply = channel.makefile("rb"), channel.sendall
    else:
        channel = None
        requests, replies = os.fdopen(args.requests, "rb"), os.fdopen(args.replies, "wb", buffering=0)
        reply = replies.write
    from harness.supervisor import Session

    # Read before the sandbox exists, and kept where it cannot read (this process is not dumpable
    # once it runs): what signs each reply, so that the controller believes only this process's.
    first = requests.readline()
    key = bytes.fromhex(json.loads(first)["key"]) if first else b""
    session = Session(args.spec.resolve().parent, list(jobs), jobs.get("bench"), private=True)
    try:
        for line in requests if key else ():
            stage = str(json.loads(line).get("stage"))
            job = jobs.get(stage) or replace(next(iter(jobs.values())), stage=stage)  # refused below
            try:
                verdict = session.stage(job)
            except Exception:
                verdict = _crashed(job)
                session.close()
            if session.over:  # the sandbox and all it started are dead before the last verdict goes
                session.close()
            body = json.dumps(json.loads(verdict.to_json())).encode()
            reply(hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n")
            if session.over:
                break
    finally:
        session.close()
        requests.close()
        if channel is not None:
            channel.close()
    return 0


def _crashed(job: Job) -> Verdict:
    verdict = Verdict(op=job.candidate.op, candidate_id=job.candidate.id, stages=[job.stage])
    verdict.crash("harness", traceback.format_exc(limit=-8))
    return verdict


if __name__ == "__main__":
    sys.exit(main())
