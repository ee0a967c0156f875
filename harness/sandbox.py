"""`python -P -m harness.sandbox FD STAGING`: the candidate's own process, started by the supervisor —
as a fork of it, with torch and the harness already imported (harness/processes.py), or as a fresh
interpreter.

It reads its limits on the first line of stdin and applies them (memory, core dumps,
network), imports the harness, torch and the op if they are not yet (a fresh interpreter does
so while the supervisor makes its plan), then takes one request a line: the bench stage's
baselines, measured before the candidate exists in this process (harness/baselines.py) and ended
by `loading`, then each stage of the candidate's session in turn, each ended by `done`. It notes
the identity of every timer and harness function and imports the candidate from its scratch
directory at each stage afresh (its module's state starts anew, as in a process of its own),
with Triton's and Inductor's caches pointed at its own (harness/caches.py). Everything it finds goes to the supervisor
as frames on FD, each output's bytes in the staging buffer STAGING (harness/channel.py), which it
reuses only once the supervisor has answered `taken` on stdin; it decides no verdict — a process that dies or stops reporting is a crash
there. In the bench stage it waits on stdin before timing each shape, until the supervisor has
judged what it was sent and left the GPU idle (`settle`), so that no work of the supervisor's
shares the GPU with a timing. It ends when stdin does, or when the supervisor kills it.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path


def main() -> int:
    from harness import limits

    stdin = sys.stdin  # this object, whatever the candidate later does to sys.stdin
    request = json.loads(stdin.readline())
    cpu_only = request["device"] == "cpu"
    memory = limits.cap_memory(request["memory_mb"], cpu_only)
    network = limits.drop_network(allow_user_namespace=cpu_only)

    import torch

    from contract.job import Job
    from engine_templates.ops import get_op
    from harness import checks, device, integrity, stages, timing  # noqa: F401  (watched below)
    from harness.baselines import measure as measure_baselines
    from harness.channel import Sender, Stager
    from harness.load import Rejected, load

    sender = Sender(int(sys.argv[1]))

    def send(kind: str, tensors=(), **fields) -> None:
        sender.send(kind, tensors, **fields)
        if tensors and not _answered(stdin, "taken"):  # the buffer is the supervisor's until then
            raise Unanswered(f"the supervisor's answer to {fields.get('item', kind)!r} did not arrive as sent")

    isolation = f"{memory}; {network}; pid {os.getpid()}"
    # Numbered: the supervisor answers each number once. Numbered from 0 before the baselines and
    # again once the candidate loads.
    settles = [itertools.count()]

    def settle() -> bool:
        return _settle(send, stdin, next(settles[0]))

    baselines, identities = None, None
    # One request a line: the bench stage's baselines (before the candidate exists in this process),
    # then each stage of the candidate's session in turn. The supervisor ends the session by closing
    # stdin, or by killing this process.
    while line := stdin.readline():
        request |= json.loads(line)
        job = Job.from_json(request["job"])
        op, dev = get_op(job.candidate.op, job.rules.dtype), request["device"]
        if dev == "cuda":
            torch.cuda.set_per_process_memory_fraction(request["gpu_memory_fraction"])
        if sender.stager is None:  # sized and sealed by the supervisor before its first request
            sender.stager = Stager(int(sys.argv[2]), dev)
        caches = request.get("caches", {})
        if request.get("part") == "baselines":  # harness/baselines.py; ends with `loading`, or a failure
            send("isolation", detail=isolation)
            os.environ.update(caches.get("baselines", {}))
            if (baselines := measure_baselines(job, op, dev, request["plan"], send, settle)) is None:
                send("done")
                return 0
            send("loading")  # from here on the candidate's code may run in this process
            settles[0] = itertools.count()
            continue
        if job.stage != "bench":  # the bench stage's judge had both at its baselines
            send("isolation", detail=isolation)
            send("loading")
        if identities is None:  # before any of the candidate's code ran here
            os.environ.update(caches.get("candidate", {}))
            identities = integrity.Identities()
        # Imported afresh at each stage, as in a process of its own: its module's state (a cache,
        # a call count) starts anew; what it left elsewhere in this process stays.
        try:
            fn = load(job.candidate, op, Path(os.getcwd()))
        except Rejected as e:
            send("gate", name=e.gate, passed=False, detail=e.detail)
            send("done")
            return 0
        except MemoryError as e:
            send("gate", name="memory", passed=False, detail=f"importing the candidate: {stages.describe_exception(e)}")
            send("done")
            return 0
        try:
            if job.stage == "bench":
                stages.bench_stage(job, op, fn, dev, request["plan"], send, baselines, settle=settle,
                                   patched=identities.changed)
            else:
                {"compile": stages.compile_stage, "check": stages.check_stage}[job.stage](job, op, fn, dev,
                                                                                          request["plan"], send)
        except Unanswered as e:
            send("gate", name="protocol", passed=False,
                 detail=f"{e}: something in the candidate's process read or closed its stdin")
            send("done")
            return 0
        patched = identities.changed()
        if patched:
            send("gate", name="timer_integrity", passed=False, detail=integrity.swapped_detail(patched))
        send("done")
    return 0


class Unanswered(Exception):
    """The supervisor's `taken` did not come as sent: something in this process read stdin."""


def _settle(send, stdin, n: int) -> bool:
    """Before a shape is timed: ask the supervisor to finish judging what it was sent and to
    leave the GPU idle, and wait for its answer. False when the answer is not the expected one
    (something in this process read or closed stdin). `n` counts the questions from 0."""
    send("settle", n=n)
    return _answered(stdin, "go")


def _answered(stdin, word: str) -> bool:
    """Whether the supervisor's next line on stdin is `word`."""
    try:
        return stdin.readline() == word + "\n"
    except (OSError, ValueError):  # closed, or its descriptor taken away
        return False


if __name__ == "__main__":
    sys.exit(main())
