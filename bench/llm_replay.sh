#!/usr/bin/env bash
# The LLM-replay row of docs/BENCHMARKS.md on one GPU host with torch and triton but no package
# index: installs the carried controller wheels (infra/controller_wheels.sh), then runs
# bench/llm_replay.py (a published free kernel replayed from the LLM's first prompt reaches its
# published speed-up with the first candidate) and keeps its table.
# Usage (repo root, wheels in .whl/):
#   OUT=dir [OP=rmsnorm] [MODEL=qwen3-8b] [DTYPE=bf16] [KERNEL=gauntlet/rmsnorm/honest_triton.py] \
#   [WITHIN=0.10] [HOMES=/tmp/infersmith-llm-replay] bash bench/llm_replay.sh
set -uo pipefail
out=${OUT:?set OUT to a folder for the results}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/llm_replay.log"
python3 bench/llm_replay.py --op "${OP:-rmsnorm}" --model "${MODEL:-qwen3-8b}" --dtype "${DTYPE:-bf16}" \
    --kernel "${KERNEL:-gauntlet/rmsnorm/honest_triton.py}" --within "${WITHIN:-0.10}" \
    --home "${HOMES:-/tmp/infersmith-llm-replay}" 2>> "$out/llm_replay.log" | tee "$out/llm_replay.md"
exit "${PIPESTATUS[0]}"
