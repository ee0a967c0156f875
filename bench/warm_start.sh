#!/usr/bin/env bash
# The warm-start row of docs/BENCHMARKS.md on one GPU host with torch and triton but no package
# index: installs the carried controller wheels (infra/controller_wheels.sh), then runs
# bench/warm_start.py (TPE from published knowledge vs cold) and keeps its table.
# Usage (repo root, wheels in .whl/):
#   OUT=dir [OPS=rmsnorm,silu_mul] [SOURCE=qwen3-8b] [TARGET=qwen3-1.7b] [BUDGET=16] [SEEDS=0,1,2] \
#   [HOMES=/tmp/infersmith-warm-start] bash bench/warm_start.sh
# Finished runs stay in HOMES: under a time limit per command, call it again until the table prints.
set -uo pipefail
out=${OUT:?set OUT to a folder for the results}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/warm_start.log"
python3 bench/warm_start.py --ops "${OPS:-rmsnorm,silu_mul}" --source "${SOURCE:-qwen3-8b}" \
    --target "${TARGET:-qwen3-1.7b}" --budget "${BUDGET:-16}" --seeds "${SEEDS:-0,1,2}" \
    --home "${HOMES:-/tmp/infersmith-warm-start}" 2>> "$out/warm_start.log" | tee "$out/warm_start.md"
