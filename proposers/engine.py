"""Engine configurations to try: per-op kernel choices (from the op leaderboards) and the
engine's knobs, drawn at random, never one already tried (history is read from tracking)."""
from __future__ import annotations

import random

from harness.serve.job import EngineCandidate

KNOBS = {
    "block_size": [16, 32],
    "max_num_seqs": [16, 32, 64, 128],
    "max_num_batched_tokens": [512, 1024, 2048, 4096],
    "cuda_graph_max_batch": [0, 8, 32, 64],
}


def propose_engines(kernel_options: dict[str, list[dict]], tried: set[str], n: int, seed: int,
                    on_gpu: bool) -> list[EngineCandidate]:
    """Up to n new configurations; fewer when the space has nothing new left."""
    rng = random.Random(f"{seed}/{len(tried)}")
    knobs = KNOBS | ({} if on_gpu else {"cuda_graph_max_batch": [0]})  # no CUDA graphs without a GPU
    out: list[EngineCandidate] = []
    seen = set(tried)
    for _ in range(200 * n):
        kernels = {op: rng.choice(options) for op, options in kernel_options.items() if len(options) > 1}
        cand = EngineCandidate(kernels={op: c for op, c in kernels.items() if c != {"impl": "eager"}},
                               origin="random", **{k: rng.choice(v) for k, v in knobs.items()})
        if cand.id not in seen:
            seen.add(cand.id)
            out.append(cand)
            if len(out) == n:
                break
    return out
