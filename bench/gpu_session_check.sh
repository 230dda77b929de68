#!/usr/bin/env bash
# All GPU tests of the repository in one device call, then `lumo generate` on the GPU; a short summary last.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rfE -s tests/ 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "accepted drafts|rel err|passed|failed|FAILED|ERROR" | tail -40
for m in "" "--model lumo/assets/lumo-tiny-nvfp4"; do
  python -m lumo.cli generate $m --device cuda --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0 \
    2>&1 >/dev/null | tail -1
  python -m lumo.cli generate $m --device cuda --spec tree --prompt "def fibonacci(n):" --max-tokens 64 \
    --temperature 0 2>&1 >/dev/null | tail -1
done
python -m lumo.cli generate --device cuda --backend kernels --prompt "def fibonacci(n):" --max-tokens 64 \
  --temperature 0 2>&1 >/dev/null | tail -1
python bench/bench_decode.py 2>&1 | tail -30
python bench/bench_spec.py 2>&1 | tail -30
