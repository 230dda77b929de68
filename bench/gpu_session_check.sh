#!/usr/bin/env bash
# Every GPU test and benchmark of the repository on the device machine, in groups with their own time
# limits (one device call allows 10 minutes), each group's log under $OUT; a short summary is printed.
#   bash bench/gpu_session_check.sh [kernels|spec|bench|all]     (default: all; "all" needs ~15 minutes)
# The speculative-engine file alone takes > 4 minutes (50 prompts x 256 tokens, eager, two models).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
what=${1:-all}
source "$(dirname "$0")/gpu_group.sh"  # $P, group()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ $what == kernels || $what == all ]]; then
  group 240 t_kernels $P tests/test_linear_gpu.py tests/test_norms_gpu.py tests/test_attention_gpu.py \
    tests/test_gdn_gpu.py tests/test_conv_gpu.py tests/test_rope_kv_gpu.py tests/test_sampling_gpu.py \
    tests/test_tree_kernels_gpu.py tests/test_runner_gpu.py
  python -m lumo.cli generate --device cuda --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0 \
    2>&1 >/dev/null | tail -1
fi
if [[ $what == spec || $what == all ]]; then
  group 540 t_spec $P -s tests/test_gpu_spec_gpu.py tests/test_llm_gpu.py tests/test_prefix_gpu.py
  grep -E "accepted drafts" "$out/t_spec.log"
fi
if [[ $what == bench || $what == all ]]; then
  group 120 bench_decode python bench/bench_decode.py --peer-layers 8
  grep -A12 "^## bench" "$out/bench_decode.log"
  group 120 bench_spec python bench/bench_spec.py
  grep -E "^27B|^GDN|^embedded" "$out/bench_spec.log"
  group 60 bench_linear python bench/bench_linear.py
  tail -30 "$out/bench_linear.log"
  group 60 bench_attention python -m bench.bench_attention
  grep "^|" "$out/bench_attention.log"
  group 120 bench_prefix python bench/bench_prefix.py
  tail -4 "$out/bench_prefix.log"
  group 180 bench_adaptive python bench/bench_adaptive.py
  tail -7 "$out/bench_adaptive.log"
fi
