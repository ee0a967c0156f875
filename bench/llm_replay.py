"""A published free kernel as the LLM proposer's starting point, measured: an LLM-proposer run whose
scripted endpoint replays the published kernel its first prompt shows reaches the published
speed-up with its first candidate. Prints one markdown row per shape class.

Two tracking homes under --home, as two teams sharing a knowledge base:
  source/  an LLM-proposer optimization of --op on --model whose scripted endpoint answers with
           --kernel (a module file); its draft entries are then published
  replay/  a fresh MLflow store holding only source/'s knowledge entries (as `kb export` leaves
           them): an LLM-proposer run on the same target, whose endpoint reads the first published
           kernel out of the prompt it was sent and answers with it
The replay's first candidate, over each entry's shapes, is then set beside the entry's speed-up.
Exit status 1 when a shape class falls short of --within of it, or the prompt held no kernel.
Run from the repo root: python3 bench/llm_replay.py [--op rmsnorm] [--model qwen3-8b] ...
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the scripted provider the tests use: the real SDK's peer

from scripted_llm import ScriptedLLM, Turn  # noqa: E402

KERNEL = re.compile(r"## Published kernels.*?```python\n(.*?)```", re.S)


class Replay(ScriptedLLM):
    """Answers every request with the first published kernel its prompt shows (none: no answer)."""

    def _next(self, request, body: dict) -> Turn | None:
        self.requests.append({"path": request.path, "headers": request.headers.copy(), "body": body})
        found = KERNEL.search(body["messages"][-1]["content"])
        return Turn(f"The nearest published kernel, as it was.\n\n```python\n{found[1]}```\n", 1000, 0, 200) \
            if found else None


def optimize(home: Path, op: str, model: str, dtype: str, endpoint: ScriptedLLM) -> str:
    """One LLM-proposer candidate in its own tracking home; the parent run's id."""
    from flows.optimize_op import optimize_op
    from proposers.llm import LLMSettings
    from targets import Target

    os.environ["INFERSMITH_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    llm = LLMSettings(provider="openai", model="replay", base_url=endpoint.url + "/v1", api_key_env=None,
                      max_retries=0, timeout_s=60)
    return optimize_op(op=op, target=Target(model=model, dtype=dtype, budget={"candidates": 1}),
                       proposer="llm", llm=llm)["parent_run_id"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="rmsnorm")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--kernel", default=str(ROOT / "gauntlet" / "rmsnorm" / "honest_triton.py"),
                   help="the module the source run's endpoint answers with")
    p.add_argument("--within", type=float, default=0.10, help="allowed shortfall of the replay (default 10%%)")
    p.add_argument("--home", default="/tmp/infersmith-llm-replay")
    a = p.parse_args()
    from tracking.history import search
    from tracking.knowledge import KnowledgeBase
    from tracking.knowledge.derive import class_speed
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    home = Path(a.home)
    shutil.rmtree(home, ignore_errors=True)
    source = Path(a.kernel).read_text()
    with ScriptedLLM([Turn(f"A kernel.\n\n```python\n{source}```\n", 1000, 0, 200)]) as endpoint:
        optimize(home / "source", a.op, a.model, a.dtype, endpoint)
    kb = KnowledgeBase(home / "source" / "knowledge")
    entries = [e for e in kb.entries("draft", a.op) if e.winner["kind"] == "free"]
    if not entries:
        print(f"the source run's kernel did not pass: no free-kernel entry of {a.op} to publish", file=sys.stderr)
        return 1
    for e in entries:
        kb.move(e.id, "published", by="bench", note="LLM replay benchmark")
    shutil.copytree(kb.root, home / "replay" / "knowledge")

    with Replay([]) as endpoint:
        parent = optimize(home / "replay", a.op, a.model, a.dtype, endpoint)
        requests = endpoint.requests
    if not requests or not KERNEL.search(requests[0]["body"]["messages"][-1]["content"]):
        print("the replay run's first prompt held no published kernel", file=sys.stderr)
        return 1
    [first] = [r for r in search(Tracker(TrackingConfig.from_env()), a.op)
               if r.data.tags.get("mlflow.parentRunId") == parent]
    print("| op | target | shape class | published (entry) | replay's first candidate | ratio |")
    print("|---|---|---|---|---|---|")
    short = False
    for e in sorted(kb.entries("published", a.op), key=lambda e: e.shape_class):
        speed = class_speed(first, e.shapes)
        got = speed[0] if speed else 0.0
        short |= got < e.score * (1 - a.within)
        print(f"| {a.op} | {e.target} | {e.shape_class} | {e.score:.3g}x ({e.id}) | {got:.3g}x "
              f"({first.data.tags.get('infersmith.status')}) | {got / e.score:.3f} |")
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
