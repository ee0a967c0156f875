"""The serve stage, in the order that wastes least: the reference's answers first (the HF
transformers reference server), then the candidate server — accuracy before any load, then
AIPerf on every pattern — and the baseline under the same load only for a candidate worth
comparing. Each server runs alone on its slots, so no two share a GPU; a target asking for
several replicas gets that many copies of the candidate (and of the baseline), each on its own
GPU, behind one load balancer, and every replica answers the accuracy prompts; a few of them, and
a fresh one each pattern, go to the URL AIPerf loads while it loads it (harness/serve/under_load.py)."""
from __future__ import annotations

import importlib.metadata
import json
import random
import shlex
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from contract.serve import Completion, EngineCandidate, Reference, Served, ServeJob, ServerError
from contract.verdict import PASS, Verdict
from harness.serve import aiperf, under_load
from harness.serve.accuracy import REFERENCE_TOP, complete, judge, prompt_set
from harness.serve.baselines import ENGINES
from harness.serve.server import Replicas, ServerProcess

# (the pattern whose load they came under, None before any load; the numbers of the prompts they
# answer; every answerer's completions: each replica's before load, the one URL's under load)
Judge = Callable[[str | None, list[int], list[list[Completion]]], tuple[bool, str, dict]]
SERVED_NAME = "infersmith-e2e"  # the model id every server is started with and AIPerf sends
READ_ERRORS = under_load.READ_ERRORS


def judge_replicas(replicas: list[list[Completion]], expected: list[Completion], rules,
                   numbers: list[int] | None = None) -> tuple[bool, str, dict]:
    """judge() on each replica's completions (of the prompts `numbers`, default all): the first
    wrong one fails the gate, named when there are several; the metrics are the worst replica's
    difference and the sums of the rest."""
    if not replicas:
        return False, "no replica's answers", {}
    several = len(replicas) > 1
    details, worst, compared, ties = [], 0.0, 0, 0
    for k, got in enumerate(replicas):
        which = f"replica {k}: " if several else ""
        passed, detail, metrics = judge(got, expected, rules, numbers)
        if not passed:
            return False, which + detail, {}
        details.append(which + detail)
        worst = max(worst, metrics["accuracy/max_logprob_diff"])
        compared += metrics["accuracy/tokens_compared"]
        ties += metrics["accuracy/near_ties"]
    return True, "; ".join(details), {"accuracy/max_logprob_diff": worst, "accuracy/tokens_compared": compared,
                                      "accuracy/near_ties": ties}


def reference_judge(reference: Reference, rules) -> Judge:
    """The judge where the reference's answers are at hand."""
    def judged(pattern: str | None, numbers: list[int], answers: list[list[Completion]]) -> tuple[bool, str, dict]:
        return judge_replicas(answers, [reference.completions[n] for n in numbers], rules, numbers)
    return judged


def host_versions(job: ServeJob) -> dict:
    """What the servers run on (the versions of job.python's packages, the GPU of the first replica,
    the driver), without importing torch or initializing CUDA here: a re-run is compared with it."""
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def smi(field: str) -> str | None:
        cmd = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader", f"--id={job.devices[0] or 0}"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            return None

    torch = version("torch") or ""
    cuda = torch.partition("+cu")[2] if job.device == "cuda" else ""  # the wheel's build, e.g. 2.9.0+cu128
    return {"kind": job.device, "torch": torch, "triton": version("triton"), "gpu_timing": job.device == "cuda",
            "name": smi("name") if job.device == "cuda" else "cpu",
            "cuda": f"{cuda[:-1]}.{cuda[-1]}" if cuda else None,
            "driver": smi("driver_version") if job.device == "cuda" else None}


def reference_argv(job: ServeJob, port: int) -> list[str]:
    return [job.python, "-m", "engine_templates.engine", "serve-reference", "--model-dir", str(job.reference_dir),
            "--dtype", job.activation_dtype, "--device", job.device, "--max-model-len", str(job.max_model_len),
            "--port", str(port), "--served-model-name", SERVED_NAME]


def engine_argv(job: ServeJob, cand: EngineCandidate, out: Path, port: int) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    kernels = out / "kernels.json"
    kernels.write_text(json.dumps(cand.kernels, indent=1))
    fp8 = ["--quantization", "fp8"] if job.dtype == "fp8" else []  # a bf16 checkpoint quantized at load
    return [job.python, "-m", "engine_templates.engine", "serve", "--model-dir", str(job.model_dir),
            "--dtype", job.activation_dtype, "--device", job.device, "--max-model-len", str(job.max_model_len),
            "--port", str(port), "--served-model-name", SERVED_NAME, *fp8, *cand.engine_args(kernels)]


def quantized(model_dir: Path) -> bool:
    """Whether the checkpoint's config.json declares quantized weights (quantization_config)."""
    try:
        return "quantization_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ServerError(f"cannot read {model_dir}/config.json: {e}") from None


def command_argv(command: str, job: ServeJob, port: int, replica: int = 0) -> list[str]:
    """A server named by a shell-like command; {port}, {model_dir}, {name} and {replica} (0, 1, ...) are
    filled in, and {python} (the host's) and {max_model_len} (the target's)."""
    return shlex.split(command.format(port=port, model_dir=job.model_dir, name=SERVED_NAME, replica=replica,
                                      python=job.python, max_model_len=job.max_model_len))


def baseline_argv(job: ServeJob, port: int, replica: int = 0) -> list[str]:
    """The baseline server's command: an engine's by name (`vllm`, `sglang`: harness/serve/baselines.py)
    or a command's."""
    if job.baseline in ENGINES:
        return ENGINES[job.baseline].argv(job, port, SERVED_NAME)
    return command_argv(job.baseline, job, port, replica)


def reference_answers(job: ServeJob, out: Path, rng: random.Random) -> tuple[Reference, dict | None]:
    """Greedy tokens and log-probabilities (with alternatives) of the reference server; and, when
    the reference is also the baseline, its metrics under every pattern from the same session."""
    # The oracle is the full-precision model: never a quantized checkpoint, whatever the candidate is.
    if quantized(job.reference_dir):
        raise ServerError(f"the reference checkpoint {job.reference_dir} is quantized (its config.json has a "
                          "quantization_config); name its bf16 original as the reference model directory")
    prompts = prompt_set(job.model_dir, job.accuracy, rng, fresh_prompts(job))
    envs = job.replica_envs if job.baseline == "reference" else job.replica_envs[:1]  # as many as it is loaded with
    with Replicas("reference", lambda _, port: reference_argv(job, port), envs, out, job.python) as ref:
        ref.start(job.start_timeout_s)
        one = ref.servers[0].url  # the replicas are one model: one answers
        reference = Reference(prompts, [complete(one, SERVED_NAME, p, job.accuracy.max_tokens, REFERENCE_TOP)
                                        for p in prompts])
        return reference, (_load_baseline(job, ref, out, prompts) if job.baseline == "reference" else None)


def measure_baseline(job: ServeJob, out: Path) -> dict[str, aiperf.PatternRun]:
    """The baseline server (an engine's by name, or a command's) under every pattern."""
    ready = "/v1/models" if job.baseline in ENGINES else job.ready_path
    with Replicas("baseline", lambda i, port: baseline_argv(job, port, i), job.replica_envs, out,
                  job.python, ready) as server:
        server.start(job.start_timeout_s)
        # prompts of the same lengths as the candidate's (the held-out ones drawn afresh): the
        # same extra work under load, never judged
        return _load_baseline(job, server, out, prompt_set(job.model_dir, job.accuracy, random.Random(0),
                                                          fresh_prompts(job)))


def _load_baseline(job: ServeJob, server: Replicas, out: Path, prompts: list[list[int]]) -> dict[str, aiperf.PatternRun]:
    """Every pattern, with the accuracy prompts a candidate gets under it too (the same load on
    both sides). A baseline that fails under load is an error of the run, not a verdict on a candidate."""
    runs = {}
    for p in job.patterns:
        runs[p.name], probes = under_load.load(p, server.url, SERVED_NAME, job.model_dir, out / "aiperf" / p.name,
                                               job.pattern_timeout_s, prompts, prompt_numbers(job, len(prompts), p.name),
                                               job.accuracy.max_tokens)
        why = [f"{runs[p.name].errors} failed requests"] if runs[p.name].errors else []
        why += [f"the accuracy prompts under load: {probes.error}"] if probes and probes.error else []
        why += [server.death("meanwhile")] if not server.alive else []
        if why:
            raise ServerError(f"the baseline failed on pattern {p.name} ({'; '.join(why)}); "
                              f"log: {server.log_tail(300)}")
    return runs


def fresh_prompts(job: ServeJob) -> int:
    """How many prompts of the set are sent under load only, one per pattern (the last ones)."""
    return len(job.patterns) if job.accuracy.under_load else 0


def prompt_numbers(job: ServeJob, prompts: int, pattern: str | None) -> list[int]:
    """The numbers of the prompts answered before load (pattern None: all but the fresh ones), or
    under a pattern's load (its fresh one among them): what each judgement compares, on this side
    or on the controller."""
    before = prompts - fresh_prompts(job)
    if pattern is None:
        return list(range(before))
    fresh = before + [p.name for p in job.patterns].index(pattern) if fresh_prompts(job) else None
    return under_load.sample(before, job.accuracy.held_out, job.accuracy.under_load, pattern, fresh)


def serve_candidate(job: ServeJob, candidate_id: str, argv_for: Callable[[int, int], list[str]],
                    reference: Reference, out: Path, judge_with: Judge | None = None) -> Served:
    """Start the candidate's replicas (argv_for(replica, port)), judge each one's accuracy (against
    reference's answers, or by judge_with where this side holds none), then load them (through
    the balancer when several) with every pattern, judging the accuracy prompts sent meanwhile."""
    verdict = Verdict(op="engine", candidate_id=candidate_id, stages=["serve"],
                      device=host_versions(job))
    result = Served(verdict)
    t0 = time.monotonic()
    judge_with = judge_with or reference_judge(reference, job.accuracy)
    with Replicas("candidate", argv_for, job.replica_envs, out, job.python, job.ready_path) as server:
        try:
            server.start(job.start_timeout_s)
        except ServerError as e:
            verdict.crash("server_start", str(e))
        if verdict.status == PASS:
            _accuracy(server, job, reference, result, judge_with)
        for p in job.patterns if verdict.status == PASS else ():
            before = engine_stats(server)
            try:
                run, probes = under_load.load(p, server.url, SERVED_NAME, job.model_dir, out / "aiperf" / p.name,
                                              job.pattern_timeout_s, reference.prompts,
                                              prompt_numbers(job, len(reference.prompts), p.name),
                                              job.accuracy.max_tokens)
            except aiperf.AIPerfError as e:
                run, failure = None, str(e)
            after = engine_stats(server) if run is not None and before is not None else None
            if after is not None:
                result.metrics |= speculation(p.name, before, after)
            death = server.death(f"during pattern {p.name}")
            if death:
                verdict.crash("server_died", death)
            elif run is None:
                verdict.crash("load", failure)
            elif run.errors:
                verdict.gate("load", False, f"{run.errors} of {run.metrics['requests']:.0f} requests failed "
                                            f"on pattern {p.name}")
            elif probes is not None:
                _accuracy_under_load(p.name, probes, judge_with, result)
            if verdict.status != PASS:
                break
            result.runs[p.name] = run
        verdict.log_tail = server.log_tail()
    verdict.wall_s = time.monotonic() - t0
    return result


def engine_stats(server: Replicas) -> list[dict] | None:
    """Every replica's /stats (engine_templates/engine/server.py), or None where one has none (a
    command's server, another engine: no speculation to report) or does not answer (a server that
    died: the stage's death check, right after, says so)."""
    readings = []
    for replica in server.servers:
        try:
            with urllib.request.urlopen(replica.url + "/stats", timeout=30) as r:
                readings.append(json.loads(r.read()))
        except (OSError, ValueError):  # HTTPError (404) and a refused connection are OSErrors
            return None
    return readings


def speculation(pattern: str, before: list[dict], after: list[dict]) -> dict[str, float]:
    """The pattern's speculative decoding, all replicas together, from /stats read before and after
    it (its warm-up requests included): draft tokens, accepted ones, and their ratio."""
    def total(readings: list[dict], key: str) -> int:
        return sum(r.get("speculative", {}).get(key, 0) for r in readings)

    if not any(r.get("speculative", {}).get("spec_tokens") for r in after):
        return {}
    drafted = total(after, "drafted_tokens") - total(before, "drafted_tokens")
    accepted = total(after, "accepted_tokens") - total(before, "accepted_tokens")
    out = {f"{pattern}/spec_drafted_tokens": drafted, f"{pattern}/spec_accepted_tokens": accepted}
    return out | ({f"{pattern}/spec_acceptance_rate": accepted / drafted} if drafted else {})


def serve(job: ServeJob, cand: EngineCandidate, reference: Reference, out: Path, command: str | None = None,
          judge_with: Judge | None = None) -> Served:
    """The serve stage for an engine configuration, or for any server `command` starts."""
    if command is None:
        return serve_candidate(job, cand.id, lambda _, port: engine_argv(job, cand, out, port), reference, out,
                               judge_with)
    return serve_candidate(job, cand.id, lambda i, port: command_argv(command, job, port, i), reference, out,
                           judge_with)


def _accuracy(server: Replicas, job: ServeJob, reference: Reference, result: Served, judge_with: Judge) -> None:
    """Every replica answers every prompt but the fresh ones (kept for the load), straight (not
    through the balancer, which would spread them), all at once; the reference judges them all: a replica that is wrong fails the gate
    like a lone server."""
    numbers = prompt_numbers(job, len(reference.prompts), None)

    def answers(replica: ServerProcess) -> list[Completion]:
        return [complete(replica.url, SERVED_NAME, reference.prompts[n], job.accuracy.max_tokens, 0) for n in numbers]

    with ThreadPoolExecutor(len(server.servers)) as pool:
        pending = [pool.submit(answers, replica) for replica in server.servers]
    several = len(server.servers) > 1
    got = []
    for k, replica in enumerate(pending):
        try:
            got.append(replica.result())
        except READ_ERRORS as e:
            death = server.death("answering the accuracy prompts")
            if death:
                result.verdict.crash("server_died", death)
            else:
                result.verdict.gate("accuracy", False, f"{f'replica {k}: ' if several else ''}no usable greedy "
                                                       f"completion with logprobs: {type(e).__name__}: {e}")
            return
    passed, detail, metrics = judge_with(None, numbers, got)
    result.metrics.update(metrics)
    result.verdict.gate("accuracy", passed, detail)


def _accuracy_under_load(pattern: str, probes: under_load.Probes, judge_with: Judge, result: Served) -> None:
    """The prompts sent during the pattern's load, judged like those before it: a wrong one fails
    the accuracy gate, naming the pattern; `<pattern>/under_load_*` beside `accuracy/*`."""
    result.metrics |= probes.metrics(pattern)
    if probes.completions is None:
        passed, judged, metrics = False, probes.error, {}
    else:
        passed, judged, metrics = judge_with(pattern, probes.numbers, [probes.completions])
    result.metrics |= under_load.renamed(pattern, metrics)
    result.verdict.gate("accuracy", passed, under_load.detail(pattern, judged, result.metrics))

