#!/usr/bin/env bash
# The op benchmarks of docs/BENCHMARKS.md, on one GPU host that has torch and triton but no
# package index: installs the carried controller wheels (infra/controller_wheels.sh), runs
# `infersmith optimize` for each op and model, and leaves the tracking store and a report.
# Usage (repo root, wheels in .whl/):
#   OUT=dir [RESTORE=home.tgz] [ARCHIVE=file.tgz] [BUDGET=8] [MODELS="qwen3-8b"] [OPS="rmsnorm"] [OP_TIMEOUT=s] bash bench/gpu_bench.sh
# OPS default: every op the engine takes a kernel for; fused_moe only at a mixture-of-experts model.
# OP_TIMEOUT: one op's wall-clock budget (no candidate starts that would end after it); a
# stage still running HARD_MARGIN (180) s later is interrupted. Finished candidates stay tracked.
# The hard limit counts from the start of `infersmith optimize`, which on a fresh host spends ~60 s
# before its flow starts (Prefect's server): keep HARD_MARGIN at 100 or more.
# EXTRA: more `infersmith optimize` options, e.g. EXTRA="--decode-batches 1,32".
# The vision ops run on their own model: MODELS=sam3 OPS="vision_linear vision_attention layernorm gelu".
set -uo pipefail
out=${OUT:?set OUT to a folder for the results}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
trap pack_home EXIT  # also when a time limit interrupts the run: what finished comes back
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$out/bench.log"
for model in ${MODELS:-qwen3-8b qwen3-30b-a3b}; do
    for op in ${OPS:-rmsnorm fused_add_rmsnorm silu_mul decode_attention rope qk_norm_rope prefill_attention fused_moe}; do
        # fused_moe has shapes only at a mixture-of-experts model's (qwen3-8b is dense): skipped, said so
        if ! python3 -c "import sys; from engine_templates.hf_config import model_dims
sys.exit(0 if sys.argv[1] != 'fused_moe' or model_dims(sys.argv[2]).is_moe else 1)" "$op" "$model"; then
            echo "== $op $model: skipped (no shapes at a dense model)" | tee -a "$out/bench.log"
            continue
        fi
        echo "== $op $model budget ${BUDGET:-8}" | tee -a "$out/bench.log"
        # The flow stops proposing when another candidate would end after OP_TIMEOUT (--wall-clock)
        # and finishes the one in flight; the hard limit is for a stage that hangs. SIGINT, not
        # SIGTERM: the flow then stops like a Ctrl-C, closing its runs.
        timeout -s INT -k 30 "$(( ${OP_TIMEOUT:-900} + ${HARD_MARGIN:-180} ))" python3 -m cli optimize \
            --op "$op" --model "$model" --budget "${BUDGET:-8}" --proposer tpe --wall-clock "${OP_TIMEOUT:-900}" \
            ${EXTRA:-} 2>&1 | grep --line-buffered -E "^\S+ \| INFO +\| Flow run .* - (\[|stopped|optimizing)|Error|error" \
            | sed -u -E 's/^.* - //' | tee -a "$out/bench.log"
        # After every op, so that a call cut short still brings back what finished.
        python3 -m cli report > "$out/report.md" 2>> "$out/bench.log"
        pack_home
    done
done
