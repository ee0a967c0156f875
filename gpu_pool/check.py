"""`infersmith pool check`: reach every host, report its GPUs and software, run the bundle there."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from contract.job import Job
from contract.verdict import PASS
from gpu_pool.executors import run_stage
from gpu_pool.health import HostFault, HostUnreachable
from gpu_pool.pool import Host, Pool, Slot
from gpu_pool.ssh import connect, run_command
from harness.serve.baselines import ENGINES

# Runs on the host with its own Python: what it has, as one JSON line. A missing package
# is a value in the report, not an error of the check.
PROBE_SOURCE = r"""
import json, subprocess, sys
info = {"python": sys.version.split()[0], "gpus": []}
try:
    import torch
    info["torch"] = torch.__version__
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        info["gpus"].append({"name": torch.cuda.get_device_name(i), "free_gib": free / 2**30})
except ImportError:
    info["torch"] = "missing"
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = "missing"
# The serve stage's needs: transformers (the reference server) and the aiperf command beside
# this interpreter or on PATH, as harness/serve/aiperf.py looks for it.
import importlib.metadata, os, shutil
def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
info["transformers"] = _version("transformers") or "missing"
beside = os.path.join(os.path.dirname(sys.executable), "aiperf")
found = beside if os.path.exists(beside) else shutil.which("aiperf")
info["aiperf"] = (_version("aiperf") or "found") if found else "missing"
# The baseline engines a target may name (serving.baseline: vllm, sglang): importable by this python?
import importlib.util
for engine in ENGINE_PACKAGES:
    info[engine] = _version(engine) or ("found" if importlib.util.find_spec(engine) else "missing")
try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout
    info["driver"] = out.splitlines()[0].strip() if out.strip() else "-"
except (OSError, subprocess.TimeoutExpired):
    info["driver"] = "-"
print(json.dumps(info))
"""
PROBE = PROBE_SOURCE.replace("ENGINE_PACKAGES", repr(tuple(e.package for e in ENGINES.values())))


@dataclass
class HostReport:
    host: Host
    reachable: bool
    detail: str = ""  # why not, when unreachable
    info: dict | None = None
    bundle: str = "-"

    @property
    def ok(self) -> bool:
        return self.reachable and self.bundle.startswith("ok")

    def row(self) -> list[str]:
        h, i = self.host, self.info or {}
        where = "local" if h.is_local else f"{h.user + '@' if h.user else ''}{h.address}:{h.port}"
        gpus = ", ".join(f"{g['name']} ({g['free_gib']:.0f} GiB free)" for g in i.get("gpus", [])) or "none (CPU)"
        status = "ok" if self.reachable else f"unreachable: {self.detail}"
        return [h.name, where, h.gpu_class, status, gpus if self.reachable else "-", i.get("driver", "-"),
                i.get("torch", "-"), i.get("triton", "-"), i.get("transformers", "-"), i.get("aiperf", "-"),
                *(i.get(e.package, "-") for e in ENGINES.values()), self.bundle]


def probe(host: Host) -> dict:
    if host.is_local:
        try:
            out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise HostFault(host, "the probe ran past 120 s") from None
        rc, stdout, stderr = out.returncode, out.stdout, out.stderr
    else:
        client = connect(host)
        try:
            rc, stdout, stderr = run_command(client, host, f"{host.python} -c {shlex.quote(PROBE)}", 120)
        finally:
            client.close()
    if rc != 0:
        raise HostFault(host, f"{host.python} failed: {(stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(stdout.strip().splitlines()[-1])


def check_host(host: Host, job_for: Callable[[Slot], Job], stage_timeout_s: float) -> HostReport:
    try:
        info = probe(host)
    except HostFault as e:
        return HostReport(host, False, e.reason)
    slot = Pool(hosts=[host]).slots()[0]
    t0 = time.monotonic()
    try:
        run = run_stage(job_for(slot), slot, stage_timeout_s)
    except HostFault as e:
        return HostReport(host, True, info=info, bundle=f"host fault: {e.reason}")
    v = run.verdict
    gate = v.failing_gate
    bundle = (f"ok ({v.stages[0] if v.stages else 'compile'} {time.monotonic() - t0:.0f} s)" if v.status == PASS
              else f"{v.status}: [{gate.name}] {gate.detail}" if gate else v.status)
    return HostReport(host, True, info=info, bundle=bundle)


def table(reports: list[HostReport]) -> str:
    head = ["host", "address", "class", "status", "GPUs", "driver", "torch", "triton", "transformers", "aiperf",
            *ENGINES, "bundle"]
    rows = [head] + [r.row() for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def serve_problems(host: Host, model_dir: str, baseline: str = "reference", images: bool = False) -> list[str]:
    """What the host lacks to serve model_dir (the directory there, aiperf, torch, transformers)
    and, when the baseline names an engine (vllm, sglang), to run it; with `images`, to run the
    image stage (a SAM 3 checkpoint there, aiperf, its servers' modules). Asked of the worker's own
    check, with the python that would run the servers, so that this and the session agree. This
    machine is asked the same way (its own python, the worker's PYTHONPATH). What the host answers
    is a problem (a workdir it cannot create, a bundle it cannot unpack, a check past its limit);
    a host that cannot be reached is a warning on stderr and [], since the dispatch's retries move
    the work to another host."""
    from gpu_pool.ssh import ensure_bundle, workdir_of, worker_env

    engine = ["--images"] if images else ["--baseline", baseline] if baseline in ENGINES else []
    if host.is_local:
        return _local_serve_problems(model_dir, engine)
    client = None
    try:
        client = connect(host)
        bundle_dir, _ = ensure_bundle(client, host, workdir_of(client, host))
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in worker_env(Pool(hosts=[host]).slots()[0], bundle_dir).items())
        rc, out, err = run_command(client, host, f"env {env} {host.python} -m harness.serve check "
                                                 f"{shlex.join([model_dir, *engine])}", 120)
    except HostUnreachable as e:
        print(f"infersmith: warning: host {host.name} could not be checked before the run ({e.reason}); "
              "the run goes on, and work sent there is retried on another host", file=sys.stderr)
        return []
    except HostFault as e:
        return [e.reason]
    finally:
        if client is not None:
            client.close()
    return _check_lines(host.python, rc, out, err)


def _local_serve_problems(model_dir: str, engine: list[str]) -> list[str]:
    """The worker's check on this machine, run as the servers are (tasks/serve.job_for)."""
    from gpu_pool.local import WORKER_ROOT

    try:
        done = subprocess.run([sys.executable, "-m", "harness.serve", "check", model_dir, *engine],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(WORKER_ROOT)})
    except subprocess.TimeoutExpired:
        return [f"{sys.executable} -m harness.serve check ran past 120 s"]
    return _check_lines(sys.executable, done.returncode, done.stdout, done.stderr)


def _check_lines(python: str, rc: int, out: str, err: str) -> list[str]:
    if rc not in (0, 1) or (rc == 1 and not out.strip()):
        return [f"{python} failed: {(err.strip().splitlines() or ['?'])[-1]}"]
    return out.strip().splitlines()
