#!/usr/bin/env bash
# Session 35's GPU checks (penalties / min-p), in groups with their own limits; logs under $OUT.
#   bash bench/gpu_session35.sh kernels|spec|bench|topk|drafter
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=${LUMO_CACHE_DIR:-/tmp/lk}
out=${OUT:-/tmp}
source "$(dirname "$0")/gpu_group.sh"  # $P, group()
case ${1:-kernels} in
kernels)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  group 170 t_sampling $P tests/test_sampling_gpu.py
  group 60 t_accept $P tests/test_tree_kernels_gpu.py -k accept
  group 150 t_runner $P tests/test_runner_gpu.py
  group 200 t_penalized $P -s tests/test_gpu_spec_gpu.py -k penalized
  ;;
spec)
  group 150 t_nvfp4 $P -s tests/test_gpu_spec_gpu.py -k "greedy_tree_equals_plain and lumo-tiny-nvfp4]"
  group 200 t_spec $P tests/test_gpu_spec_gpu.py -k "seeded_sampling or graph_replay or plain_steps_between"
  group 150 t_llm $P tests/test_llm_gpu.py tests/test_logprobs_gpu.py tests/test_prefix_gpu.py
  ;;
bench)
  group 300 b_sampling python bench/bench_sampling.py --repeats 3
  tail -32 "$out/b_sampling.log"
  ;;
topk)
  group 120 t_sampling $P tests/test_sampling_gpu.py
  group 60 t_accept $P tests/test_tree_kernels_gpu.py -k "accept"
  group 200 t_spec $P tests/test_gpu_spec_gpu.py -k "seeded_sampling or penalized"
  ;;
drafter)
  group 90 t_tree $P tests/test_tree_kernels_gpu.py -k "topk or accept"
  group 60 t_sampling $P tests/test_sampling_gpu.py
  group 150 t_penalized $P -s tests/test_gpu_spec_gpu.py -k "penalized or graph_replay"
  group 120 b_sampling python bench/bench_sampling.py --repeats 3
  tail -9 "$out/b_sampling.log"
  ;;
esac
