"""The LLM proposer: the op description (proposers/describe.py) in, one free-candidate module out.

Call order:
  1. `LLMProposer(op, target, settings, knowledge, kernels)` once per optimization (cheap; no
     I/O); `knowledge`: the text of the published knowledge entries for the op and GPU class;
     `kernels`: the published winners of the nearest targets (tracking.knowledge.for_code), whose
     code and speed-ups every request, the first included, shows as starting points.
  2. `propose(history, ceilings)` once per free pool slot, from as many threads at once. `history`
     is every trial of this op, target and GPU class that tracking knows of, templates' and free
     candidates' alike, pending ones included; `ceilings` the class's, where measured.
  3. Nothing else: like every proposer it keeps no state between calls.

Every reply becomes a Proposal with its tokens and dollars. A reply holding no code, or a module
already tried, is `malformed`: its candidate is the reply itself, which no gate runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from contract.job import Candidate
from proposers.describe import describe, render_history, render_op
from proposers.llm.client import EndpointDown, Usage, ask, redact
from proposers.llm.reply import extract_module
from proposers.llm.settings import LLMSettings, SettingsError
from tracking.trials import Ceilings, Trial

if TYPE_CHECKING:
    from targets import Target
    from tracking.knowledge import Entry

SYSTEM = """You are a GPU kernel engineer making one op of an LLM inference engine faster.
Write one Python module that defines, at top level, a function `{signature}` computing what the
reference computes, for the target's dtype, and returning new output tensor(s) of the reference's
shape in the inputs' dtype on the inputs' device. Use PyTorch and Triton (`import triton`,
`import triton.language as tl`); the template below is a working starting point.

Every module is judged in its own process: checked against the float64 reference on fresh random
inputs of several distributions and sizes (including awkward ones), then timed per shape against
eager PyTorch and torch.compile. It is rejected if it mutates its inputs, returns memory holding an
earlier result, caches results across calls (it may cache what it derives from the persistent
arguments), works on another stream or thread, returns a lazy tensor, touches timers or files,
calls the op's own PyTorch implementation, or is faster than the measured roofline allows.

Reply with at most a few sentences on what you changed and why, then exactly one ```python block
holding the whole module."""


@dataclass(frozen=True)
class Proposal:
    candidate: Candidate | None  # None: the endpoint gave no reply
    usage: Usage
    usd: float
    prompt: str  # as sent, system prompt first
    reply: str
    stop_reason: str = ""
    malformed: str = ""  # why the reply is no usable module; "" when it is one
    error: str = ""  # why there is no reply: the flow stops proposing


class LLMProposer:
    def __init__(self, op: str, target: Target, settings: LLMSettings, knowledge: Sequence[str] = (),
                 kernels: Sequence[Sequence[Entry]] = ()):
        self.op, self.target, self.settings, self.knowledge = op, target, settings, list(knowledge)
        self.kernels = [list(g) for g in kernels]

    def messages(self, history: Sequence[Trial], ceilings: Ceilings | None) -> tuple[str, str, str]:
        """System prompt, the part of the user message that stays the same through an
        optimization, and the part that grows with the history."""
        d = describe(self.op, self.target, history, ceilings, knowledge=self.knowledge, kernels=self.kernels)
        return SYSTEM.format(signature=d.signature), render_op(d), render_history(d)

    def propose(self, history: Sequence[Trial], ceilings: Ceilings | None = None) -> Proposal:
        system, cached, fresh = self.messages(history, ceilings)
        prompt = f"[system]\n{system}\n\n[user]\n{cached}{fresh}"
        try:
            reply = ask(self.settings, system, cached, fresh)
        except (EndpointDown, SettingsError) as e:
            return Proposal(None, Usage(), 0.0, prompt, "", error=str(e))
        key = self.settings.api_key()
        text = redact(reply.text, key)
        module = extract_module(text, self.op)
        tried = {t.candidate.id: t.candidate.label for t in history}
        why = ""
        if module is None:
            why = ("the reply holds no Python code" if reply.text.strip() else "the reply is empty") + \
                  f" (stop reason {reply.stop_reason or 'none'}, {reply.usage.output_tokens} output tokens)"
        else:
            cand = Candidate(self.op, "free", source=module, origin=self.settings.origin)
            if cand.id in tried:
                why = f"the module repeats {tried[cand.id]}, tried before"
        if why:  # the candidate is the reply: every malformed reply is a run of its own
            cand = Candidate(self.op, "free", source=text, origin=self.settings.origin)
        return Proposal(cand, reply.usage, reply.usage.usd(self.settings.price), redact(prompt, key), text,
                        reply.stop_reason, malformed=why)
