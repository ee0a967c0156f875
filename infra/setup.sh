#!/usr/bin/env bash
# Create the project's virtual environment and install infersmith into it (editable).
# Usage: bash infra/setup.sh [VENV_DIR]   (default .venv)
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
"$python" -c 'import sys; assert sys.version_info >= (3, 11), "infersmith needs Python 3.11 or newer"'
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, pinned, unless one is there: a bare `torch` requirement would pull the
# newest CUDA build (several GB) even on a machine with no GPU.
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    "$venv/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
"$venv/bin/python" -m pip install -q -e '.[dev]'
echo "infersmith installed in $venv: activate with  . $venv/bin/activate"
