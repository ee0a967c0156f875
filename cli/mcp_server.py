"""The MCP server of `infersmith mcp` (cli/mcp.py): an outside agent proposes candidates.

It speaks MCP on stdin/stdout (the official `mcp` SDK) for one target and one pool. Its
tools are what a code-writing proposer has, nothing more: the ops, an op's description (the one
the LLM proposer's prompt carries, proposers/describe.py), the judging of a candidate's source
through the same stages and gates as any other, logged in MLflow as proposed by
`agent:<the client's name>`, and the leaderboard. No tool reads the harness, the oracle's inputs
or the held-out shapes: a verdict comes back with its gates (a failure on a held-out shape
without its detail, no detail with its inputs' seed), the shown shapes' timings, and no log of
the candidate's process, which could print the sizes it was called with.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from engine_templates.ops import OPS, get_op, ops_for
from gpu_pool.pool import Pool
from proposers.describe import SEED
from targets import Target
from targets.held_out import withheld

if TYPE_CHECKING:
    from flows.search.stops import SessionBudget

INSTRUCTIONS = """\
infersmith judges inference kernels. Write a Python module that defines a function named after the
op with the op's signature (describe_op shows the signature, the reference, the shapes timed and the
best and failed candidates so far), then call evaluate with its source. Every candidate runs in its
own process through compile, check (against a float64 reference, on fresh inputs, shapes you are
not shown included) and microbench (against eager PyTorch and torch.compile); a gate that rejects it
is named in the verdict. Score: geometric-mean speed-up over the best baseline on the shown shapes."""

TokenCount = Annotated[int, Field(ge=0, description="tokens you spent writing this candidate, if you know them")]


def agent_name(ctx: Context) -> str:
    """`agent:<name>` from the client's `clientInfo`, in characters a tag and a label can carry."""
    params = ctx.session.client_params
    name = params.client_info.name if params is not None else ""
    return "agent:" + (re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:64] or "unknown")


def agent_verdict(result: dict) -> dict:
    """What the agent reads of an evaluation: nothing of the held-out shapes, no oracle seed, no
    process log."""
    v = result["verdict"]
    timings = [{"shape": t["label"], "dims": t["dims"], "latency_us": (t["candidate_us"] + t["candidate_us_repeat"]) / 2,
                "eager_us": t["eager_us"], "compile_us": t["compile_us"], "roofline_us": t["roofline_us"]}
               for t in v["timings"]]
    return {"status": v["status"], "score": v["metrics"].get("score"), "failing_gate": v["failing_gate"],
            "gates": [{"name": g["name"], "passed": g["passed"], "detail": withheld(SEED.sub("", g["detail"]))}
                      for g in v["gates"]],
            "flags": v["flags"], "max_rel_error": v["max_rel_error"], "timings": timings,
            "gpu_timing": bool(v["device"].get("gpu_timing")), "run_id": result["run_id"]}


def build_server(target: Target, pool: Pool, budget: SessionBudget | None = None) -> MCPServer:
    """The server for one target and pool, and the session's budget; tracking is where
    TrackingConfig.from_env() says."""
    from flows.optimize_op import scope_for
    from tracking.history import board, ceilings, trials
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    server = MCPServer("infersmith", instructions=INSTRUCTIONS)


    def fitting(op: str):
        try:
            spec = get_op(op, target.dtype)
        except KeyError as e:
            raise ToolError(e.args[0]) from None
        try:
            target.op_shapes(spec)
        except ValueError as e:
            raise ToolError(f"{op} on {target.model}: {e}") from None
        return spec

    @server.tool()
    def list_ops() -> list[dict[str, Any]]:
        """The ops of this server's target: name, signature, what it computes, whether it fits the model."""
        out = []
        for op in ops_for(target.dtype).values():
            try:
                fitting(op.name)
                fits = True
            except ToolError:
                fits = False
            out.append({"op": op.name, "signature": op.signature, "summary": op.summary,
                        "persistent_arguments": list(op.persistent), "fits_target": fits})
        return out

    @server.tool()
    def describe_op(op: str) -> str:
        """Everything needed to write a candidate for `op`, as Markdown: signature, reference, the
        baseline, how inputs are built, the shapes timed with their bytes, FLOPs and roofline, the
        GPU's ceilings, the template to start from, the published kernels of the nearest targets and
        the published knowledge for the op and the pool's GPU class, the best passed candidates and
        the last failures."""
        from proposers.describe import describe, render
        from tracking.knowledge import KnowledgeBase, for_code, published_for

        fitting(op)
        tracker = Tracker(TrackingConfig.from_env())
        scope = scope_for(op, target, pool)
        kb = KnowledgeBase.from_env()
        return render(describe(op, target, trials(tracker, scope, None),
                               ceilings(tracker, scope.gpu_class, target.dtype),
                               knowledge=[e.body for e in published_for(op, scope.gpu_class, kb)],
                               kernels=for_code(op, scope, target.dtype, kb).kernels))

    @server.tool()
    def search_knowledge(query: str, op: str | None = None) -> list[dict[str, Any]]:
        """Published knowledge entries (what won for an op, shape class, GPU class and target, its
        margin over torch.compile, the gates that stopped other candidates), those holding the most
        of the query's words first; every published entry of `op` for an empty query."""
        from tracking.knowledge import search

        if op is not None and op not in OPS:
            raise ToolError(f"unknown op {op!r}; known: {', '.join(sorted(OPS))}")
        return [{"id": e.id, "op": e.op, "shape_class": e.shape_class, "gpu_class": e.gpu_class, "target": e.target,
                 "score": e.score, "speedup_vs_compile": e.vs_compile, "failures": e.failures, "text": e.body}
                for e in search(query, op)]

    @server.tool()
    def evaluate(op: str, source: str, ctx: Context, input_tokens: TokenCount = 0,
                 cached_input_tokens: TokenCount = 0, output_tokens: TokenCount = 0) -> dict[str, Any]:
        """Judge a candidate module (its Python source, defining a function named after `op`) through
        compile, check and microbench on the pool. Logged in MLflow like every candidate. Returns the
        verdict: status (pass, fail or crash), every gate with its detail, and per shown shape its time
        beside eager's, torch.compile's and the roofline's, in microseconds."""
        from flows.evaluate_op import evaluate_candidate
        from tracking.ledger import Charge

        fitting(op)
        refused = budget.admit() if budget else None
        if refused:
            raise ToolError(f"not judged: {refused}")
        charge = Charge(input_tokens=input_tokens, cached_input_tokens=cached_input_tokens,
                        output_tokens=output_tokens, self_reported=True)
        held = 0.0
        try:
            result = evaluate_candidate(op=op, source=source, target=target, name=f"{agent_name(ctx)} candidate",
                                        pool=pool, origin=agent_name(ctx), charge=charge)
            held = result["gpu_seconds"]
        finally:
            if budget:
                budget.settle(held)
        return agent_verdict(result)

    @server.tool()
    def leaderboard(op: str, limit: Annotated[int, Field(ge=1, le=100)] = 10) -> list[dict[str, Any]]:
        """The passed candidates of `op` for this target, best score first."""
        fitting(op)
        ranked = board(Tracker(TrackingConfig.from_env()), op, target.model, limit, target=target.key())
        return [{"rank": e.rank, "candidate": e.label, "candidate_id": e.candidate_id, "score": e.score,
                 "speedup_vs_eager": e.vs_eager, "speedup_vs_compile": e.vs_compile,
                 "pct_roofline": e.pct_roofline, "device": e.device, "gpu_timing": e.gpu_timing}
                for e in ranked.entries]

    return server
