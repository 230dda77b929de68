#!/usr/bin/env bash
# Session 11's GPU checks in two device calls: `spec` (the speculative-engine tests, ~9 minutes) and
# `rest` (the tree-kernel tests, then bench_spec.py); logs under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=${LUMO_CACHE_DIR:-/tmp/lk}
out=${OUT:-/tmp}
P="python -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE"
t0=$SECONDS
if [[ ${1:-spec} == spec ]]; then
  timeout 570 $P -s tests/test_gpu_spec_gpu.py > "$out/t_spec.log" 2>&1
  echo "spec rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_spec.log")"
  grep -E "^(FAILED|ERROR)|accepted drafts" "$out/t_spec.log"
else
  timeout 200 $P tests/test_tree_kernels_gpu.py tests/test_llm_gpu.py > "$out/t_tree.log" 2>&1
  echo "tree+llm rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_tree.log")"
  grep -E "^(FAILED|ERROR)" "$out/t_tree.log" | head
  timeout 200 python bench/bench_spec.py > "$out/bench_spec.log" 2>&1
  echo "bench_spec rc=$? $((SECONDS - t0))s"
  grep -E "^(embedded|27B|GDN)" "$out/bench_spec.log"
fi
