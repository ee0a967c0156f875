#!/usr/bin/env bash
# The end-to-end table of docs/BENCHMARKS.md on one GPU host that has torch and triton but no
# package index: per model preset, a random-weight checkpoint at its shape (made once, on the
# GPU, under CKPT_ROOT), then `infersmith serve-bench` of the engine against the HF transformers
# reference server under AIPerf, every pattern of the serving file.
# Usage (repo root, wheels in .whl/ from infra/controller_wheels.sh):
#   OUT=dir [MODELS="qwen3-8b"] [SERVING=bench/serving-h200-short.yaml]
#   [KERNELS=engine_templates/engine/bench/templates.json] [CKPT_ROOT=/dev/shm]
#   [STAGE_TIMEOUT=s] [RESTORE=home.tgz] [ARCHIVE=file.tgz] [DEVICE=cuda] [DTYPE=bf16|fp8]
#   [SPEC_TOKENS=n] [BASELINE=eager|reference|command] [MAX_MODEL_LEN=4096] bash bench/serve_bench_gpu.sh
# SERVING= (empty) uses the preset's own traffic; KERNELS= (empty) serves every op eager (the
# default file takes each op's Triton template default); DEVICE is where the random weights are drawn.
# DTYPE=fp8: the engine quantizes the bf16 checkpoint to FP8 at load and is judged against the bf16
# reference (use SERVING=bench/serving-h200-fp8.yaml: the FP8 thresholds); SPEC_TOKENS: the engine
# with speculative decoding of that many draft tokens. BASELINE=eager: against this engine with every
# op eager and its default settings (same dtype, FP8 weights too, no speculative decoding), what the
# kernels and SPEC_TOKENS gain; its context length is MAX_MODEL_LEN (default 4096, the serving
# settings' default max_model_len). Results go to serve-<model>[-fp8][-specN][-vs-eager].*
# CKPT_ROOT defaults to /dev/shm: qwen3-8b is 16 GB, qwen3-30b-a3b 61 GB, more than a small disk
# holds beside the OS. Leaves serve-<model>.txt (the table and gates), serve-<model>.log and the
# tracking store (home.tgz: MLflow SQLite with AIPerf's exports as artifacts).
set -uo pipefail
out=${OUT:?set OUT to a folder for the results}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
trap pack_home EXIT  # also when a time limit interrupts the run: what finished comes back
serving=${SERVING-bench/serving-h200-short.yaml}
kernels=${KERNELS-engine_templates/engine/bench/templates.json}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$out/serve.log"
for model in ${MODELS:-qwen3-8b}; do
    dir=${CKPT_ROOT:-/dev/shm}/infersmith-$model
    if [ ! -f "$dir/config.json" ]; then
        python3 -m engine_templates.engine random-checkpoint --preset "$model" --out "$dir" --device "${DEVICE:-cuda}" \
            2>&1 | tee -a "$out/serve.log" || exit 1
    fi
    name=$model${DTYPE:+-$DTYPE}${SPEC_TOKENS:+-spec$SPEC_TOKENS}
    baseline=${BASELINE:-}
    if [ "$baseline" = eager ]; then
        name=$name-vs-eager
        baseline="python3 -m engine_templates.engine serve --model-dir {model_dir} --port {port} --served-model-name {name}"
        baseline+=" --dtype bf16 --max-model-len ${MAX_MODEL_LEN:-4096}$([ "${DTYPE:-bf16}" = fp8 ] && echo ' --quantization fp8')"
    fi
    echo "== serve-bench $name" | tee -a "$out/serve.log"
    python3 -m cli serve-bench --model-dir "$dir" --model "$model" --dtype "${DTYPE:-bf16}" \
        ${SPEC_TOKENS:+--spec-tokens "$SPEC_TOKENS"} ${baseline:+--baseline "$baseline"} \
        ${serving:+--serving "$serving"} --stage-timeout "${STAGE_TIMEOUT:-600}" \
        ${kernels:+--kernels "$kernels"} > "$out/serve-$name.txt" 2> "$out/serve-$name.log"
    echo "exit $?" | tee -a "$out/serve.log"
    cat "$out/serve-$name.txt"
    pack_home  # after every model, so that a call cut short still brings back what finished
done
