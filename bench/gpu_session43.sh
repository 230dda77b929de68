#!/usr/bin/env bash
# Session 43's GPU checks, two device calls:
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session43.sh a")  # ~6 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session43.sh b")  # ~5 min
# b: after attn_prefill was kept off cuDNN (bench/probe_sdpa.py): the attention and prefix-cache GPU tests
#    and probe_first_prompt again; bench_prefix at 32k with the default park raised to 32768.
# The prefix-cache GPU tests with two parked lines (a conversation and a sub-agent's), where the first
# prefill of a new prompt length spends its time (probe_first_prompt: bench_prefix's first 600-token side
# request took 1.66 s on an H100, later ones 0.12-0.15 s), and bench_prefix with the sub-agent table.
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
  group 200 t_attn $P tests/test_attention_gpu.py tests/test_prefix_gpu.py
  group 120 first python bench/probe_first_prompt.py
  tail -12 "$out/first.log"
  group 150 prefix python bench/bench_prefix.py --contexts 32768 --trials 1  # the default park now 32768
  tail -5 "$out/prefix.log"
  ;;
esac
