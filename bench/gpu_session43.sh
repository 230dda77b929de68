#!/usr/bin/env bash
# Session 43's GPU checks, one device call per mode:
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session43.sh a")  # ~6 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session43.sh b")  # ~2 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session43.sh c")  # ~4 min
# b: after attn_prefill was kept off cuDNN (bench/probe_sdpa.py): probe_first_prompt again, the prefill
#    attention and warm-up GPU tests. c: the prefix-cache GPU tests on the final code and bench_prefix at
#    32k with the default park raised to 32768 (the sub-agent table).
# a: the prefix-cache GPU tests with two parked lines (a conversation and a sub-agent's), where the first
#    prefill of a new prompt length spends its time (probe_first_prompt: bench_prefix's first 600-token side
#    request took 1.66 s on an H100, later ones 0.12-0.15 s), and bench_prefix with the sub-agent table.
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk PYTHONPATH=.:.gpu-deps
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "${1:-a}" in
a)
  group 150 t_prefix $P tests/test_prefix_gpu.py
  group 120 first python bench/probe_first_prompt.py
  tail -12 "$out/first.log"
  group 300 prefix python bench/bench_prefix.py --trials 3
  tail -14 "$out/prefix.log"
  ;;
b)
  group 100 first python bench/probe_first_prompt.py --lengths 600 600 700 1500 130
  tail -9 "$out/first.log"
  group 90 t_attn $P tests/test_attention_gpu.py tests/test_llm_gpu.py -k "prefill or warm_up"
  ;;
c)  # not run in session 43 (no device time left): the rest, on the final code
  group 150 t_prefix $P tests/test_prefix_gpu.py
  group 150 prefix python bench/bench_prefix.py --contexts 32768 --trials 1  # the default park now 32768
  tail -5 "$out/prefix.log"
  ;;
esac
