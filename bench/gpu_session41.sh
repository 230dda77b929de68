#!/usr/bin/env bash
# What sessions 39-41 wrote without a GPU, in two device calls (each under the 600 s limit):
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session41.sh a")  # ~5 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session41.sh b")  # ~6 min
# a: session 39's yarn RoPE (rope_kv.cu's rope_scale: kernel and runner tests), session 40's lazy loading
#    (the LLM GPU tests and `lumo check`, whose reference reads lazily too), session 41's start-up check of
#    the context against free memory and warm-up (test_llm_gpu), prompt logprobs with their ranks (tree ==
#    plain in test_logprobs_gpu).
# b: what warm-up moves off the first request (bench_first_request), greedy tree == plain and the
#    speculative tests (every attention launch passing rope_scale).
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk PYTHONPATH=.:.gpu-deps
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "${1:-a}" in
core)  # a without `lumo check`, when little device time is left (~5 min)
  group 150 t_rope $P tests/test_rope_kv_gpu.py tests/test_runner_gpu.py
  group 150 t_llm $P tests/test_llm_gpu.py tests/test_logprobs_gpu.py
  ;;
a)
  group 150 t_rope $P tests/test_rope_kv_gpu.py tests/test_runner_gpu.py
  group 150 t_llm $P tests/test_llm_gpu.py tests/test_logprobs_gpu.py
  group 90 check python -m lumo check
  ;;
b)
  group 120 first python bench/bench_first_request.py
  tail -5 "$out/first.log"
  group 200 t_greedy $P -s tests/test_gpu_spec_gpu.py -k "greedy_tree_equals_plain and not 27b and not drafter"
  group 200 t_spec $P tests/test_gpu_spec_gpu.py -k "structured or graph_replay or chain or seeded"
  ;;
esac
