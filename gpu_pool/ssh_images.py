"""The image stage (harness/serve/images.py) on a pool host over SSH, through the text stage's
sessions (gpu_pool/ssh_serve.py): two `python -m harness.serve run-images` there
(harness/serve/remote_images.py is the other side). The reference session draws the held-out
images from this side's seed and sends them back with the reference's answers, which stay in
memory here; the candidate session gets the images and the queries to return mask logits for,
and hands the engine's answers back, which are judged here; its load runs only on this side's
word. The all-metrics gate is this side's too. Each session's `out/` comes back under
out/reference and out/candidate, where the stage on this machine writes them.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from contract.images import IMAGE_METRICS, ImageServeJob
from contract.serve import PatternRun, Served, ServerError, compare
from contract.verdict import PASS, Verdict
from gpu_pool.ssh_serve import ACCURACY_S, STOP_S, SSHSessions, how_it_ended, own_accuracy, raise_error, tail_of
from harness.serve.images import judge, only_queries
from harness.serve.remote import runs_from_dict
from harness.serve.remote_images import job_to_dict

CANDIDATE = "sam3-engine"


def image_session_limit_s(job: ImageServeJob) -> float:
    """When the controller gives up on a session: its server's start, the held-out images, every
    pattern, and stopping the server, each within its own bound."""
    return job.start_timeout_s + ACCURACY_S + len(job.patterns) * job.pattern_timeout_s + 2 * STOP_S


def shipped(kernels: Path | None) -> dict:
    """The kernels file as the candidate session carries it: its text, and the source of each free
    kernel it names (a path here; relative to the file), which the host writes beside its copy.
    What cannot be read here stays as written, for the engine there to refuse in its own words."""
    if kernels is None:
        return {"kernels_text": None, "sources": {}}
    text = kernels.read_text()
    try:
        choices = json.loads(text)
    except ValueError:
        choices = None
    sources = {}
    for op, choice in choices.items() if isinstance(choices, dict) else ():
        path = choice.get("path") if isinstance(choice, dict) and choice.get("impl") == "free" else None
        if isinstance(path, str) and path:
            try:
                sources[op] = (kernels.parent / path).read_text()  # an absolute path stays itself
            except (OSError, UnicodeDecodeError):
                continue
    return {"kernels_text": text, "sources": sources}


class SSHImages(SSHSessions):
    """The image stage's sessions on a leased slot of a pool host (its GPU both servers see, or
    the CPU of a CPU-only host)."""

    worker = "run-images"

    def _wire(self, job: ImageServeJob) -> dict:
        return job_to_dict(job)

    def _stage_limit_s(self, job: ImageServeJob) -> float:
        return image_session_limit_s(job)

    def stage(self, job: ImageServeJob, kernels: Path | None, out: Path, seed: int | None = None) -> Served:
        """The whole image stage: the reference's answers and baseline, then the engine with
        `kernels` judged against them. A reference that fails is the run's error, as here."""
        seed = seed if seed is not None else random.SystemRandom().randrange(2**63)
        result, answers = self._session("images-reference", job, out / "reference", {"seed": seed},
                                        secret="answers.json")
        raise_error(result, self.slot.host, self.label, "reference")
        if answers is None:
            raise ServerError(f"the reference session on {self.label} ended without its answers")
        images = [(image, list(prompts)) for image, prompts in answers["images"]]
        baseline = runs_from_dict(result["runs"], out / "reference")
        return self.candidate(job, kernels, images, answers["answers"], baseline, out / "candidate")

    def candidate(self, job: ImageServeJob, kernels: Path | None, images: list[tuple[str, list[str]]],
                  expected: list[dict], baseline: dict[str, PatternRun], out: Path) -> Served:
        judged: dict[str | None, tuple[bool, str, dict]] = {}

        def decide(pattern: str | None, raw: bytes) -> tuple[bool, dict]:
            """The engine's answers judged here against the reference's. Anything on the host may
            have written the file (the engine runs as the same user): what does not parse fails."""
            try:
                judged[pattern] = judge(json.loads(raw), expected, job.accuracy)
            except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
                judged[pattern] = (False, f"the answers from {self.label} do not parse ({type(e).__name__}: "
                                          f"{str(e)[:200]})", {})
            return judged[pattern][0], {}

        payload = {"candidate_id": CANDIDATE, "images": images, "queries": only_queries(expected), **shipped(kernels)}
        t0 = time.monotonic()
        result, _ = self._session("images-candidate", job, out, payload, (decide, [None]))
        if "verdict" not in result:
            raise_error(result, self.slot.host, self.label, "candidate", verdict_instead=True)
            verdict = Verdict(op="engine", candidate_id=CANDIDATE, stages=["serve"], log_tail=tail_of(out / "worker.log"))
            verdict.crash("serve_session", f"the image session on {self.label} {how_it_ended(result)}; what it left "
                                           "is kept (worker.log and the server's log)")
            verdict.wall_s = time.monotonic() - t0
            return Served(verdict)
        served = Served(Verdict.from_dict(result["verdict"]), runs_from_dict(result["runs"], out), result["metrics"])
        served.verdict.candidate_id = CANDIDATE
        own_accuracy(served, judged, ())
        if served.verdict.status == PASS:
            compare(served, baseline, job.margin, IMAGE_METRICS)
        return served
