#!/usr/bin/env bash
# On the GPU machine, from the repo root: gpu tests of the linears, then the benchmark (table printed last).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=${LUMO_CACHE_DIR:-/tmp/lumo-kernels}
OUTDIR=${OUT:-bench/results}
mkdir -p "$OUTDIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python -c "from lumo.kernels.compile import include_dirs, nvrtc_version; print(include_dirs(), nvrtc_version())"
python -m pytest -q -m gpu tests/test_linear_gpu.py --maxfail=4 2>&1 | tee "$OUTDIR/tests.log" | tail -25
python bench/bench_linear.py "$@" 2>&1 | tee "$OUTDIR/bench.log"
