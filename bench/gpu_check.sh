#!/usr/bin/env bash
# `make gpu-check` on a GPU host (bench/gpu_check.py says what it runs): the carried controller
# wheels (.whl/, from infra/controller_wheels.sh) installed once per host, then the suite.
# Usage (repo root): [OUT=dir] bash bench/gpu_check.sh
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
if [ -d .whl ]; then
    source "$(dirname "$0")/gpu_env.sh"
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PREFECT_SERVER_ANALYTICS_ENABLED=false
    export INFERSMITH_HOME=${INFERSMITH_HOME:-/tmp/infersmith-home} PREFECT_HOME=/tmp/prefect-home
fi
OUT=$out exec python3 bench/gpu_check.py "$@"
