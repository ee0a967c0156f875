"""The supervisor's reading of the sandbox's report: the plan it hands out, the outputs it
judges against its own oracle, the timings it turns into roofline numbers, and how the
sandbox ended. Nothing in a frame is believed beyond what can be checked here."""
from __future__ import annotations

import time
from typing import BinaryIO, Callable

import torch

from contract.job import Job
from contract.verdict import BEYOND_TOLERANCE, PASS, ShapeTiming, Verdict
from engine_templates.ops import get_op
from engine_templates.ops.base import activation_dtype, generator
from harness import baselines
from harness import device as devices
from harness.channel import CutOff, ProtocolError, Staging, brief, check_timing, item_index, read_frame, staging_size
from harness.checks import judge
from harness.deadline import Deadline
from harness.plan import bench_plan, check_plan, probe_items
from harness.stages import refill_seed, shapes_by_label


def output_bytes(job: Job) -> int:
    """What the staging buffer must hold for one call's outputs at the job's shapes: never more
    bytes than the call moves (`Op.bytes` counts each output written once)."""
    op, dtype = get_op(job.candidate.op, job.rules.dtype), activation_dtype(job.rules.dtype)
    return staging_size(max(op.bytes(s, dtype) for s in shapes_by_label(job).values()), op.n_outputs)


class Judge:
    def __init__(self, job: Job, v: Verdict, sources: dict[str, str] | None = None):
        """`sources`: the worker's trees as the supervisor hashed them (the baselines' key)."""
        self.job, self.v, self.op, self.sources = job, v, get_op(job.candidate.op, job.rules.dtype), sources or {}
        self.marks: dict[str, float] = {}  # when the sandbox said isolation, loading, done
        self.book: baselines.Book | None = None
        self.device = devices.pick(job.device)
        self.dtype, self.shapes = activation_dtype(job.rules.dtype), shapes_by_label(job)
        v.device = devices.describe(self.device)
        self.judged, self.worst, self.done = 0, 0.0, False
        self._go: Callable[[], bool] = lambda: True  # read() sets the real one
        self.graph_judged = 0  # of the judged outputs, those of timed calls (graph, events or wall clock)
        self.graph_outputs: dict[str, int] = {}  # per shape, how many of those the sandbox announced
        self.judged_by_shape: dict[str, set[str]] = {}  # bench outputs judged per shape: "refill/0", "graph/5", …
        self.items: set[str] = set()  # every output item judged: the sandbox sends each once
        self.settles = 0  # settle frames answered: the sandbox numbers its own from 0, and again after loading
        self.compiling: list[str] = []  # compile stage: the shapes called so far, in order
        self.plan = {"compile": dict, "check": lambda: check_plan(job), "bench": self._bench_plan}[job.stage]()
        self.output_bytes = output_bytes(job)

    def _bench_plan(self) -> dict:
        bench = bench_plan(self.job, self.op, self.device, self.v.device, self.sources)
        self.roofline, self.key, self.book = bench.roofline, bench.key, bench.book
        return bench.plan

    # -- reading --------------------------------------------------------------
    def read(self, stream: BinaryIO, stop: Callable[[], None], go: Callable[[], bool] = lambda: True,
             killed: Callable[[], bool] = lambda: False, until: str = "done", staging: Staging | None = None,
             taken: Callable[[], bool] = lambda: True) -> None:
        """Frames until the sandbox is done, ends, or a gate fails (then it is stopped). `go`
        answers a `settle` frame: the sandbox waits for it before it times a shape; False when
        the answer could not be written at once (the answers before it lie unread). `staging`:
        the buffer whose bytes a frame's tensors point at, copied out of it onto this judge's
        device as each frame is read; `taken` then tells the sandbox it may reuse the buffer
        (False, as `go`: the answer could not be written at once). What is judged is that copy
        alone, whatever the buffer holds afterwards. `killed`
        says whether the harness killed the sandbox (at the stage's limit, or over its memory): then
        a frame cut short is the kill's doing, the end of the report and not a fault in it. `until`:
        the frame that ends this reading (`loading`: the bench stage's baselines, read before the
        session's first stage); the sandbox lives on after it unless a gate failed."""
        self._go = go
        while self.v.status == PASS and not self.done and until not in self.marks:
            try:
                frame = read_frame(stream, staging, self.device)
            except ProtocolError as e:
                if isinstance(e, CutOff) and killed():
                    return
                self.v.gate("protocol", False, f"the sandbox's report is not well-formed ({e}): "
                                               "something in its process wrote to the harness's channel")
                break
            if frame is None:
                return
            if frame[1] and not taken():
                # The sandbox reads each `taken` before it sends its next output: a full stdin means
                # the candidate's process sent these frames.
                self.v.gate("protocol", False, "the sandbox's stdin is full of answers nothing read: something in "
                                               "the candidate's process sent output frames")
                break
            try:
                self._take(*frame)
            except ProtocolError as e:  # a frame the sandbox never writes: the candidate's process did
                self.v.gate("protocol", False, f"a frame the sandbox never sends ({e}): something in its "
                                               "process wrote to the harness's channel")
                break
        if self.v.status != PASS or until not in self.marks:
            stop()

    def _take(self, header: dict, tensors: list[torch.Tensor]) -> None:
        kind = header["kind"]
        if kind in ("isolation", "loading", "done"):
            if kind in self.marks:
                raise ProtocolError(f"a second {kind} frame")
            self.marks[kind] = time.perf_counter()
        if kind == "done":
            self.done = True
        elif kind == "isolation":
            self.v.device["isolation"] = str(header.get("detail", ""))
        elif kind == "loading":  # in the bench, the baselines are known now or never
            self.settles = 0
            if self.book and (problem := self.book.start_loading()):
                self.v.gate("protocol", False, problem)
            elif self.book:
                self.v.baselines = self.book.record(self.key)
        elif kind in ("baseline", "drift") and self.book:
            self.book.take(kind, header)
        elif kind == "gate":
            # The sandbox reports failed gates, names none of the harness's own, passes one gate
            # only: `compile`, once every shape was called, and crashes only measuring baselines,
            # before the candidate loads. A forged frame would otherwise pass a stage, or turn it
            # into the platform's crash.
            name, passed, crash = header.get("name"), header.get("passed"), header.get("crash", False)
            compiled = len(self.compiling) == len(self.job.shapes) + len(self.job.odd_shapes)
            if (not isinstance(name, str) or name in HARNESS_GATES or type(crash) is not bool
                    or (crash and (name != "baseline" or "loading" in self.marks)) or type(passed) is not bool
                    or (passed and not (name == "compile" and self.job.stage == "compile" and compiled and not crash))):
                raise ProtocolError(f"a gate frame {brief(header)}")
            detail = str(header.get("detail", ""))
            self.v.crash(name, detail) if crash else self.v.gate(name, passed, detail)
        elif kind == "compiling" and self.job.stage == "compile":
            # The sandbox announces every shape once, in the job's order: anything else was
            # written by the candidate, and would name what a stopped stage was doing.
            order = [s.label for s in [*self.job.shapes, *self.job.odd_shapes]]
            if order[len(self.compiling):len(self.compiling) + 1] != [header.get("shape")]:
                self.v.gate("protocol", False, f"a compiling frame for {str(header.get('shape'))[:80]!r} after "
                                               f"{len(self.compiling)} of the {len(order)} shapes, out of their order")
                return
            self.compiling.append(header["shape"])
        elif kind == "outputs":
            self._judge(str(header.get("item")), tensors)
        elif kind == "settle" and self.job.stage == "bench":
            # The sandbox numbers its settle frames 0, 1, 2…: one out of that order, or a copy,
            # was written by something else in its process.
            if type(header.get("n")) is not int or header["n"] != self.settles:
                raise ProtocolError(f"a settle frame numbered {str(header.get('n'))[:40]}; the sandbox's next "
                                    f"is {self.settles}")
            self.settles += 1
            # Every frame before this one is judged (frames are read in order); once this
            # process's GPU work has finished too, the sandbox may time. With this judging still
            # on the GPU, torch.compile's graph replays at the next shape read 15% faster than
            # timed alone (silu_mul, qwen3-30b-a3b decode_b32 on the H200: 1.81 against 2.14 us;
            # docs/BENCHMARKS.md).
            if self.device == "cuda":
                torch.cuda.synchronize()
            if not self._go():
                # The sandbox reads each answer before it sends its next settle, so at most one
                # lies unread: a full stdin means the candidate's process sent these frames.
                self.v.gate("protocol", False, "the sandbox's stdin is full of go-aheads nothing read: something "
                                               "in the candidate's process sent settle frames")
        elif (kind == "timing" and self.job.stage == "bench" and isinstance(header.get("label"), str)
              and header["label"] in self.roofline):
            # One per shape, announcing how many outputs of its timed calls follow. A second one,
            # or a negative count, was written by the candidate: a stage stopped at its limit
            # would keep it as a timing whose outputs were all judged.
            check_timing(header)
            if not self.book.loaded:
                raise ProtocolError(f"a timing frame for {header['label']} before the candidate was loaded")
            graph_outputs = header["graph_outputs"]
            if header["label"] in self.graph_outputs or graph_outputs < 0:
                self.v.gate("protocol", False, f"a timing frame for {header['label']} announcing {graph_outputs} "
                                               "timed-call outputs: the sandbox sends one per shape, the count "
                                               "at least 0")
                return
            roof, nbytes, flops = self.roofline[header["label"]]
            fields = {k: header[k] for k in ("label", "dims", "candidate_us", "candidate_us_repeat", "method")}
            fields |= {k: header[k][:2] for k in ("reps", "steady") if k in header}
            base = self.book.shapes[header["label"]]  # measured before the candidate loaded
            fields |= {"eager_us": base["eager_us"], "compile_us": base["compile_us"]}
            l2 = self.v.device.get("l2_bytes", 0) if self.device == "cuda" else 0
            cover = header["sets"] * nbytes / l2 if l2 else 0.0
            self.v.timings.append(ShapeTiming(**fields, roofline_us=roof, bytes=nbytes, flops=flops,
                                              l2_cover=cover))
            self.graph_outputs[header["label"]] = graph_outputs
        else:
            self.v.gate("protocol", False, f"unexpected frame {kind!r} in the {self.job.stage} stage")

    # -- judging outputs ------------------------------------------------------
    def _args(self, shape_label: str, seed: int, dist: str = "normal") -> tuple:
        """The oracle's arguments for one call: drawn from the seed the candidate's were (for an fp8
        target, the full-precision op's, with the weights before quantization: ops/fp8.py)."""
        return self.op.oracle.inputs(self.shapes[shape_label], self.dtype, self.device, generator(self.device, seed),
                                     dist)

    def _judge(self, item: str, outs: list[torch.Tensor]) -> None:
        parts = item.split("/")
        try:
            if parts[0] == "check" and len(parts) == 2:
                call = self.plan["calls"][item_index(parts[1])]
                args, gate = self._args(call["shape"], call["seed"], call["dist"]), "accuracy"
                where = f"{call['shape']} ({call['dist']} inputs, seed {call['seed']})"
            elif parts[0] == "bench" and len(parts) == 4 and parts[2] in ("timed", "refill", *TIMED_RUNS, *REFILLED):
                spec, phase, n = self.plan["shapes"][item_index(parts[1])], parts[2], item_index(parts[3])
                timed = phase in TIMED_RUNS or phase in REFILLED
                j = n % len(spec["sets"]) if timed else n  # call n of a timed run used set n % sets
                args = self._args(spec["shape"], spec["sets"][j])
                if phase == "refill" or phase in REFILLED:  # refilled after the timings, or inside one
                    seed = refill_seed(spec, j) if phase == "refill" else spec["timed_refill"]["repeat" in phase]
                    fresh = self._args(spec["shape"], seed)
                    args = tuple(a if self.op.oracle.is_persistent(i) or not isinstance(a, torch.Tensor) else fresh[i]
                                 for i, a in enumerate(args))
                gate = "caching" if phase == "refill" or phase in REFILLED else "timed_outputs"
                where = (f"{spec['shape']} (call {n} of the {phase.removesuffix('-refilled')} timing, input set {j}"
                         f"{', refilled between two timed calls' if phase in REFILLED else ''})" if timed
                         else f"{spec['shape']} ({phase} input set {j})")
            else:
                raise ValueError(item)
        except (ValueError, IndexError, KeyError):
            self.v.gate("protocol", False, f"outputs for {item!r}, which the plan never asked for")
            return
        if item in self.items:
            self.v.gate("protocol", False, f"outputs for {item!r} a second time")
            return
        self.items.add(item)
        run = parts[0] == "bench" and (parts[2] in TIMED_RUNS or parts[2] in REFILLED)  # what a timed call returned
        rtol = self.job.rules.rtol
        result = judge(self.op.oracle, outs, args, self.job.rules.approval_rtol or rtol)
        if result.ok and result.rel_error > rtol and BEYOND_TOLERANCE not in self.v.flags:
            self.v.flags.append(BEYOND_TOLERANCE)
        self.judged += 1
        if parts[0] == "bench":
            self.judged_by_shape.setdefault(spec["shape"], set()).add(f"{phase}/{n}")
        self.graph_judged += run
        self.worst = max(self.worst, result.rel_error)
        self.v.max_rel_error = self.worst
        if result.ok:
            return
        if gate == "timed_outputs" and self._stale(spec, j, outs):
            gate = "caching"
            where = where.removesuffix(")") + (", refilled between two timed calls before it: the result of those "
                                               "values, returned for its own)")
        detail = f"{where}: {result.detail}"
        if result.gate == "accuracy" and self.job.rules.approval_rtol:
            detail += f" (the approval tolerance; the target's own is {rtol:g})"
        if gate == "caching":
            detail += (" — after its inputs were refilled in place with new values (same storage, pointers and "
                       "shapes) the result is stale: cached on pointer, shape or something else than the values")
            if run:
                detail += ", and the cache used while timed"
        elif run and phase.startswith("graph"):
            detail += (" — what the CUDA graph that was timed computed: the candidate does less (or other work) "
                       "while captured than when called")
        elif run:
            detail += (" — what a call returned while it was timed: the candidate does less (or other work) when "
                       "timed than when its outputs are otherwise checked")
        self.v.gate(result.gate if gate == "accuracy" else gate, False, detail)

    def _stale(self, spec: dict, j: int, outs: list[torch.Tensor]) -> bool:
        """Whether outputs wrong for input set `j` are right for the values a timing refilled it
        with (`timed_refill`): the timings refill sets in place as they go (timing.Kept), and a
        result cached on pointer while one was refilled comes back for its own values later."""
        own = self._args(spec["shape"], spec["sets"][j])
        for seed in spec["timed_refill"]:
            fresh = self._args(spec["shape"], seed)
            args = tuple(a if self.op.oracle.is_persistent(i) or not isinstance(a, torch.Tensor) else fresh[i]
                         for i, a in enumerate(own))
            if self._gives(outs, args):
                return True
        return False

    def _gives(self, outs: list[torch.Tensor], args: tuple) -> bool:
        """Whether `outs` are what the oracle gives on `args`, within tolerance."""
        return judge(self.op.oracle, outs, args, self.job.rules.approval_rtol or self.job.rules.rtol).ok

    # -- the end --------------------------------------------------------------
    def memory_exceeded(self, rss_mb: float) -> None:
        detail = (f"the candidate's process reached {rss_mb:.0f} MiB resident, over the "
                  f"{self.job.rules.memory_mb} MiB limit, and was killed")
        self.v.crash("memory", self._ended_early(detail))

    def finish(self, returncode: int | None, deadline: Deadline | None = None) -> None:
        v = self.v
        if v.status != PASS:
            return
        if not self.done and deadline is not None and deadline.struck and not deadline.ended_first:
            v.crash("time_limit", f"{self.job.stage} stage ran past its {deadline.limit_s:g} s limit: the harness "
                                  f"killed the candidate's process after {deadline.expired_after:.0f} s, keeping "
                                  f"{deadline.limit_s - deadline.expired_after:.0f} s to write this verdict; "
                                  f"{self._progress()}")
            return
        if not self.done:
            how = f"killed by signal {-returncode}" if returncode and returncode < 0 else f"exit code {returncode}"
            v.crash("process", self._ended_early(f"the candidate's process ended ({how}) before its report was complete"))
            return
        if self.job.stage == "compile" and not any(g.name == "compile" and g.passed for g in v.gates):
            # a `done` with no pass before it: the candidate's process wrote it
            total = len(self.job.shapes) + len(self.job.odd_shapes)
            v.gate("protocol", False, f"the compile stage's report ended without its pass, after "
                                      f"{len(self.compiling)} of {total} shapes were called")
        elif self.job.stage == "check":
            expected = len(self.plan["calls"])
            if self.judged != expected:
                v.gate("protocol", False, f"{self.judged} of {expected} planned calls reported")
                return
            rules = self.job.rules
            within = (f"{self.worst:.3g} <= {rules.rtol:g}" if self.worst <= rules.rtol else
                      f"{self.worst:.3g} > the target's tolerance {rules.rtol:g}, <= its approval tolerance "
                      f"{rules.approval_rtol:g}: a person decides")
            v.gate("correctness", True, f"{expected} calls over {len(self.shapes)} shapes; worst relative error "
                                        f"{within} (judged outside the sandbox)")
        elif self.job.stage == "bench":
            expected = {s["shape"] for s in self.plan["shapes"]}
            if {t.label for t in v.timings} != expected or len(v.timings) != len(expected):
                v.gate("protocol", False, f"timings for {sorted(t.label for t in v.timings)}; planned {sorted(expected)}")
                return
            probes = sum(len(probe_items(s)) for s in self.plan["shapes"])
            graph_outputs = sum(self.graph_outputs.values())
            if self.judged - self.graph_judged != probes or self.graph_judged != graph_outputs:
                v.gate("protocol", False, f"{self.judged - self.graph_judged} of {probes} probe outputs and "
                                          f"{self.graph_judged} of {graph_outputs} timed-call outputs reported")
                return
            refilled = sum(i.split("/")[0] in REFILLED for items in self.judged_by_shape.values() for i in items)
            if refilled != 2 * len(expected):
                v.gate("protocol", False, f"{refilled} outputs of calls on inputs refilled while timed reported; "
                                          f"each of the {len(expected)} shapes' two timings has one")
                return
            speed_of_light(self.job, v)

    def _ended_early(self, detail: str) -> str:
        """`detail` of a sandbox that ended on its own or was killed over its memory, with what a
        check or bench got through (a bench keeps only judged timings)."""
        return f"{detail}; {self._progress()}" if self.job.stage != "compile" else detail

    def _progress(self) -> str:
        """What the stage had done when it was stopped, in the verdict's words."""
        if self.job.stage == "check":
            return f"{self.judged} of {len(self.plan['calls'])} planned calls judged, all within tolerance"
        if self.job.stage == "bench":
            # A shape's timing is kept only once everything its timed calls returned and its
            # probes returned was judged: the timing frame comes before those outputs.
            plan = {s["shape"]: s for s in self.plan["shapes"]}

            def all_judged(label: str) -> bool:
                items = self.judged_by_shape.get(label, set())
                graphs = [i for i in items if i.split("/")[0] in TIMED_RUNS or i.split("/")[0] in REFILLED]
                return probe_items(plan[label]) <= items and len(graphs) == self.graph_outputs.get(label, 0)

            judged = [t for t in self.v.timings if all_judged(t.label)]
            unjudged = [t.label for t in self.v.timings if t not in judged]
            self.v.timings = judged
            left = [label for label in plan if label not in {t.label for t in judged} | set(unjudged)]
            return "; ".join([f"{len(judged)} of {len(plan)} shapes timed and judged (kept below)"]
                             + ([f"timed but not yet judged (dropped): {', '.join(unjudged)}"] if unjudged else [])
                             + ([f"not timed: {', '.join(left)}"] if left else []))
        if not self.compiling:
            return "the candidate had not finished loading (importing it ran past the limit)"
        total = len(self.job.shapes) + len(self.job.odd_shapes)
        return (f"its first call on shape {self.compiling[-1]} had not returned "
                f"({len(self.compiling) - 1} of {total} shapes compiled before it)")


HARNESS_GATES = {"time_limit", "harness", "process"}  # written by the supervisor alone
# The bench stage's timed runs whose calls' outputs are judged: the candidate's first timing and
# its repeat, by each method (harness/timing.py).
TIMED_RUNS = tuple(f"{how}{repeat}" for how in ("graph", "events", "wall") for repeat in ("", "-repeat"))
# Their calls that ran on an input set refilled in place inside the run, judged for `caching`.
REFILLED = tuple(f"{run}-refilled" for run in TIMED_RUNS)


def speed_of_light(job: Job, v: Verdict) -> None:
    if not v.gpu_timing:
        v.gate("speed_of_light", True, "no GPU timing (CPU / interpreter): not applicable")
        return
    for t in v.timings:
        if t.fastest_us < t.roofline_us / job.rules.sol_margin:
            v.gate("speed_of_light", False,
                   f"{t.label}: {t.fastest_us:.2f} us is faster than the measured roofline "
                   f"{t.roofline_us:.2f} us allows ({100 * t.roofline_us / t.fastest_us:.0f}% of roofline)")
            return
    v.gate("speed_of_light", True, f"every shape within {job.rules.sol_margin:g}x of the measured roofline")

