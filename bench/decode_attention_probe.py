"""What bounds decode_attention at batch 1: the split_kv template against two floors, timed the
way the harness times candidates (CUDA-graph replay, inputs rotated past the L2, median).

For each shape (qwen3-8b and qwen3-30b-a3b heads, batch 1, 4,096 and 32,768 context, paged and
contiguous) it times:

  copy floor      a device copy of the same byte count (half read, half written), the
                  measurement the bandwidth ceiling comes from, at this call's size
  launch floor    one launch of a kernel on split_kv's grid that loads the sequence length and
                  stores one number per program: what a call costs before it reads the cache
  stream floor    one launch on the same grid that reads every K and V tile split_kv reads
                  (same partition, same table lookups) and stores one number per program:
                  the memory system's time for the bytes, without softmax or a combine
  split_kv ...    template points: the split count (0: auto), the tile, warps and stages
  eager, compile  the op's eager baseline (SDPA over the gathered cache) and torch.compile of it

Each line is timed twice: as the harness times candidates (harness.timing.median_us: one
replay of a graph of one call per input set between two events), and "ahead": the same graph
replayed back to back, timed over a batch of replays that the host has queued ahead of the
device, so that no graph launch latency can fall inside the events. Where the two differ, the
harness's figure carries launch latency.

Every template point's output is checked against the float64 reference: the last input set's
output as the graph's last replay left it, so a fast point that combines wrongly shows as an error, not a time.
Percentages are of the shape's roofline bytes at the copy bandwidth given (--copy-tbps, default
an H200 measured 4.25 TB/s).

Usage (a GPU host, repo root): python3 bench/decode_attention_probe.py [--presets qwen3-8b,...]
    [--contexts 4096,32768] [--quick]
Prints one line per variant: harness timing (us, % of roofline), the ahead timing, and for
the op's implementations the relative error against the reference.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from engine_templates.models import PRESETS
from engine_templates.ops.base import generator
from engine_templates.ops.decode_attention import OP, SPLIT_KV_TEMPLATE
from engine_templates.ops.decode_attention.templates import _sm_count, auto_splits
from harness.checks import rel_error
from harness.timing import Method, median_us, rotation_count


@triton.jit
def _launch_floor(SEQ_LENS, OUT):
    n = tl.load(SEQ_LENS)
    p = (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2))
    tl.store(OUT + p, n.to(tl.float32))


@triton.jit
def _stream_floor(K, V, SEQ_LENS, BLOCK_TABLE, OUT, stride_kb, stride_kp, stride_kh, stride_bt,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        p_mask = pos < end
        if PAGED:
            block = tl.load(BLOCK_TABLE + pos // PAGE_SIZE, mask=p_mask, other=0).to(tl.int64)
            rows = block * stride_kb + (pos % PAGE_SIZE) * stride_kp
        else:
            rows = pos.to(tl.int64) * stride_kp
        at = rows[:, None] + kv_head * stride_kh + d[None, :]
        k = tl.load(K + at, mask=p_mask[:, None], other=0.0)
        v = tl.load(V + at, mask=p_mask[:, None], other=0.0)
        total += k.to(tl.float32) + v.to(tl.float32)
    tl.store(OUT + kv_head * NUM_SPLITS + split, tl.sum(tl.sum(total, axis=1), axis=0))


def ahead_us(fn, arg_sets, batch_ms: float = 0.5, samples: int = 30) -> float:
    """Per call: one graph of one call per input set, replayed back to back; each sample times
    a batch of replays behind one untimed replay already queued."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kept = [fn(*args) for args in arg_sets]
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        graph.replay()
    e.record()
    e.synchronize()
    per_replay_ms = s.elapsed_time(e) / 10
    batch = max(2, min(200, int(batch_ms / per_replay_ms)))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for s, e in pairs:
        graph.replay()  # queued ahead of the start event
        s.record()
        for _ in range(batch):
            graph.replay()
        e.record()
    torch.cuda.synchronize()
    del kept, graph
    ms = sorted(s.elapsed_time(e) for s, e in pairs)[samples // 2]
    return ms * 1e3 / batch / len(arg_sets)


def floors(args, splits: int, block_n: int, num_warps: int = 4):
    q, k, v, seq_lens, table, scale = args
    kv_heads = k.shape[2]
    out = torch.empty(kv_heads * splits, dtype=torch.float32, device=q.device)
    grid = (1, kv_heads, splits)
    paged = table is not None

    def launch(q, k, v, seq_lens, table, scale):
        _launch_floor[grid](seq_lens, out)
        return out

    def stream(q, k, v, seq_lens, table, scale):
        _stream_floor[grid](k, v, seq_lens, table if paged else seq_lens, out,
                            k.stride(0), k.stride(1), k.stride(2), table.stride(0) if paged else 0,
                            HEAD_DIM=k.shape[3], BLOCK_N=block_n, NUM_SPLITS=splits, PAGED=paged,
                            PAGE_SIZE=k.shape[1] if paged else 1, num_warps=num_warps)
        return out

    return launch, stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--copy-tbps", type=float, default=4.25)
    ap.add_argument("--quick", action="store_true", help="fewer template points")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        # A smoke run of the script itself (TRITON_INTERPRET=1, a small preset and context);
        # its times are the interpreter's and mean nothing.
        dev, l2, name = "cpu", 1 << 20, "CPU (Triton interpreter)"
    else:
        dev, l2, name = "cuda", torch.cuda.get_device_properties(0).L2_cache_size, torch.cuda.get_device_name()
    method = Method(dev, warmup_ms=25.0, rep_ms=200.0, graph=True)
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy bandwidth taken as {a.copy_tbps} TB/s")
    base = dict(SPLIT_KV_TEMPLATE.default)
    for preset, ctx in itertools.product(a.presets.split(","), [int(c) for c in a.contexts.split(",")]):
        dims = PRESETS[preset]
        for shape in OP.shapes(dims, [1], [], [ctx]):
            nbytes = OP.bytes(shape, torch.bfloat16)
            sets = rotation_count(nbytes, l2)
            arg_sets = [OP.inputs(shape, torch.bfloat16, dev, generator(dev, s), "normal") for s in range(sets)]
            want = OP.reference(*arg_sets[-1])
            ideal_us = nbytes / (a.copy_tbps * 1e12) * 1e6
            print(f"\n## {preset} {shape.label}: {nbytes / 1e6:.1f} MB a call, roofline {ideal_us:.2f} us, "
                  f"{sets} input sets rotated")

            def show(name, fn, check=True, sets=arg_sets):
                t = median_us(fn, sets, method)
                err = ""
                if check:  # what the last input set's call returned, as the timing left it
                    got = t.outputs[len(sets) - 1][0] if t.outputs else fn(*sets[-1])
                    e = rel_error(got, want)
                    err = f"  rel.err {e:.1e}" + ("  WRONG" if e > 1e-2 else "")
                ahead = ahead_us(fn, sets) if dev == "cuda" else float("nan")
                print(f"{name:52s} {t.us:8.2f} us {100 * ideal_us / t.us:5.1f}%   ahead {ahead:8.2f} us "
                      f"{100 * ideal_us / ahead:5.1f}%{err}", flush=True)

            copies = [(torch.empty(nbytes // 2, dtype=torch.uint8, device=dev),
                       torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)) for _ in range(sets)]
            show("copy floor (dst.copy_(src), same bytes)", lambda d, s: d.copy_(s), False, copies)
            del copies
            auto = auto_splits(1, dims.kv_heads, ctx, base["block_n"], _sm_count(torch.device(dev)))
            for splits, block_n, warps in [(auto, 64, 4), (32, 64, 4), (32, 128, 4), (32, 128, 8), (16, 128, 8)]:
                launch, stream = floors(arg_sets[0], splits, block_n, warps)
                if block_n == 64 and warps == 4:
                    show(f"launch floor, {splits} splits", launch, check=False)
                show(f"stream floor, {splits} splits, block_n {block_n}, {warps} warps", stream, check=False)
            points = [base]
            grid = itertools.product([0, 32], [64, 128], [4, 8], [1, 2])
            if a.quick:
                grid = itertools.product([0], [64, 128], [4], [1, 2])
            for ns, bn, nw, st in grid:
                p = {"num_splits": ns, "block_n": bn, "num_warps": nw, "num_stages": st}
                if p not in points:
                    points.append(p)
            for p in points:
                label = "split_kv " + ",".join(f"{k}={v}" for k, v in p.items())
                show(label, SPLIT_KV_TEMPLATE.build(p))
            show("eager (SDPA over the gathered cache)", OP.eager)
            if dev == "cuda":
                show("torch.compile(eager)", torch.compile(OP.eager))

if __name__ == "__main__":
    main()
