#!/usr/bin/env bash
# The GPU run, as the device tool calls it from the repository root ($OUT set there):
#   bash benchmark/gpu/run.sh [run_gpu.py flags]     (carry: bundle)
# Installs the bundle (scripts/bundle_gpu.py) beside the machine's torch, puts the
# sgl_kernel shim on the path and runs benchmark/gpu/run_gpu.py.
set -u
SITE=/tmp/site
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" bundle/wheels/*.whl \
    || { echo "bundle install failed"; exit 1; }
export PYTHONPATH="$SITE:$PWD"
SHIM=$("$PY" -m sgl_importance.platform.cuda_shim) || { echo "plugin not importable"; exit 1; }
export PYTHONPATH="$SITE:$SHIM:$PWD"
export PYTHONUNBUFFERED=1
exec "$PY" -m benchmark.gpu.run_gpu --out "${OUT:-/tmp/gpu-run}" "$@"
