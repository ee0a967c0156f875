# Sourced by the GPU-host scripts (gpu_bench.sh, serve_bench_gpu.sh): on a host with torch and
# triton but no package index, installs the carried controller wheels (.whl/, made by
# infra/controller_wheels.sh) once per host and wheel set, and sets the environment of a run.
# Needs `out` set to the results folder.
stamp=$(ls .whl | sha256sum | cut -c1-16)
if [ "$(cat /tmp/site/.infersmith-wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$out/pip.log" 2>&1 || { tail -5 "$out/pip.log"; exit 1; }
    echo "$stamp" > /tmp/site/.infersmith-wheels
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 PREFECT_HOME=/tmp/prefect-home
export INFERSMITH_HOME=${INFERSMITH_HOME:-/tmp/infersmith-home} PREFECT_SERVER_ANALYTICS_ENABLED=false
# RESTORE: a home.tgz from an earlier call, so that runs accumulate in one tracking store.
if [ -n "${RESTORE:-}" ] && [ -f "$RESTORE" ]; then tar xzf "$RESTORE" -C "$(dirname "$INFERSMITH_HOME")"; fi
source "$(dirname "${BASH_SOURCE[0]}")/pack_home.sh"
