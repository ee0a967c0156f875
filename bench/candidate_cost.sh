#!/usr/bin/env bash
# What a candidate costs on one GPU host that has torch and triton but no package index: installs
# the carried controller wheels (infra/controller_wheels.sh), then runs bench/candidate_cost.py —
# a TPE search of each budget in BUDGETS — and appends its markdown breakdown to $OUT/cost.md.
# Usage (repo root, wheels in .whl/):
#   OUT=dir [OP=rmsnorm] [MODEL=qwen3-8b] [BUDGETS="24 100"] [ARCHIVE=file.tgz] [EXTRA="--wall-clock 270"] \
#   bash bench/candidate_cost.sh
# EXTRA: more `infersmith optimize` options; --wall-clock S stops proposing when another candidate
# would end after S seconds (under a time limit per command, the breakdown then still prints).
# Each budget is a flow of its own; the later ones' proposer sees the earlier ones' trials.
set -uo pipefail
out=${OUT:?set OUT to a folder for the results}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
# Also every 30 s meanwhile: a time limit that kills this script (no EXIT trap then) still leaves
# a store at most 30 s old, whose breakdown `candidate_cost.py --report` prints.
(while sleep 30; do [ -d "$INFERSMITH_HOME" ] && pack_home; done) &
packer=$!
trap 'kill $packer 2>/dev/null; pack_home' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$out/cost.md"
for budget in ${BUDGETS:-24 100}; do
    # the commit, and "+changes" where the tree differs from it (a copied tree may carry an older .git)
    rev="$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo '+changes')"
    echo "## ${OP:-rmsnorm} ${MODEL:-qwen3-8b}, TPE, budget $budget ($rev)" \
        | tee -a "$out/cost.md"
    python3 bench/candidate_cost.py --op "${OP:-rmsnorm}" --model "${MODEL:-qwen3-8b}" --budget "$budget" \
        ${EXTRA:+-- $EXTRA} 2>> "$out/cost.log" | tee -a "$out/cost.md"
    pack_home
done
