#!/usr/bin/env bash
# Download, for a GPU host that has torch and triton but no package index, the wheels that
# running the controller there (`infersmith optimize`, `serve-bench` with local Prefect and MLflow,
# and AIPerf, the end-to-end stage's load generator) needs.
# Packages the host already has (its `pip list`, one name a line, in HAVE) are left out.
# Usage: HAVE=host-packages.txt [PYTHON=python] [AIPERF=0] bash infra/controller_wheels.sh OUT_DIR [PYTHON_VERSION]
# PYTHON: the controller's python, whose MLflow version the host gets (default: the checkout's .venv).
# AIPERF=0: without AIPerf and what only it needs (pyarrow, pandas, scipy...), for hosts that run
# op optimizations, the gauntlet and the engine bench but not the end-to-end stage.
set -euo pipefail
out=${1:?usage: controller_wheels.sh OUT_DIR [PYTHON_VERSION]}
pyver=${2:-3.12}
all=$(mktemp -d)
plats=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    plats+=(--platform "${p}_x86_64")
done
# MLflow at this environment's version (PYTHON: default the checkout's .venv, else python3): the
# host's tracking store comes back here, and MLflow opens only a store of its own schema.
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$([ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3)}
if v=$("$py" -c 'import mlflow; print(mlflow.__version__)' 2>/dev/null); then
    mlflow_req="mlflow-skinny==$v"
else
    mlflow_req="mlflow-skinny>=3.1,<4"
    echo "controller_wheels: no mlflow in $py; the host gets the newest mlflow-skinny, whose store this" \
         "environment may not open (set PYTHON to the controller's python)" >&2
fi
python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${plats[@]}" -d "$all" "prefect>=3.4,<4" "$mlflow_req" "sqlalchemy>=2" alembic \
    sqlparse "optuna>=4.0" "paramiko>=3.4" "pydantic>=2.7,<3" pyyaml "matplotlib>=3.8" \
    $([ "${AIPERF:-1}" = 0 ] || echo "aiperf>=0.13,<0.14")
mkdir -p "$out"
norm() { tr 'A-Z_.' 'a-z--' ; }
# Pieces that no command run on such a host imports (`make gpu-check`, `infersmith optimize` and
# `gauntlet`, bench/serve_bench_gpu.sh with AIPerf), left out so that the set fits a 64 MiB carry
# with room: cloud artifact stores (S3 is not used there); AIPerf's plots, dashboards and audio
# datasets (`aiperf plot`, the textual UI, soundfile: the stage runs `aiperf profile --ui-type
# none` on text); Prefect's integrations (notifications, Kubernetes, Docker), its dev server's file
# watcher and its date parser for human input, MLflow's git lookup; and the optional accelerators
# that their importers fall back from (zstandard and brotli for HTTP bodies, httptools for
# uvicorn, ruamel.yaml's C loader). Checked by running those commands with these modules made
# unimportable, every process logging what it imports (docs/bench.md).
skip="botocore boto3 s3transfer jmespath plotly dash dash-bootstrap-components kaleido choreographer
      textual datasets apprise kubernetes-asyncio kopf docker gitpython gitdb smmap flask
      soundfile multiprocess rich-rst dateparser watchfiles zstandard brotli httptools ruamel-yaml-clib"
for f in "$all"/*.whl; do
    name=$(basename "$f" | cut -d- -f1 | norm)
    case " $(echo $skip) " in *" $name "*) continue ;; esac
    # (the pinned mlflow-skinny goes whatever the host has: its version is the point)
    if [ "$name" != mlflow-skinny ] && [ -n "${HAVE:-}" ] && norm < "$HAVE" | grep -qx "$name"; then continue; fi
    cp "$f" "$out/"
done
rm -rf "$all"
du -sh "$out"
