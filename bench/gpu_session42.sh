#!/usr/bin/env bash
# What sessions 39-42 wrote without a GPU, in three device calls (each under the 600 s limit):
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session42.sh a")  # ~5 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session42.sh b")  # ~6 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session42.sh c")  # ~6 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session42.sh d")  # ~5 min
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session42.sh e")  # ~6 min
# a: session 39's yarn RoPE (rope_kv.cu's rope_scale: kernel and runner tests); session 40's lazy loading
#    (the LLM GPU tests, `lumo check`); session 41's context check, warm-up and prompt-logprob ranks;
#    session 42's whole-context reservation by the warm-up (test_llm_gpu) and parked prefix (test_prefix_gpu).
# b: what warm-up moves off the first request (bench_first_request); bench_prefix with a side request
#    between the turns (session 42's parked prefix on the 27B).
# c: greedy tree == plain and the speculative tests (every attention launch passing rope_scale).
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk PYTHONPATH=.:.gpu-deps
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "${1:-a}" in
a)
  group 150 t_rope $P tests/test_rope_kv_gpu.py tests/test_runner_gpu.py
  group 200 t_llm $P tests/test_llm_gpu.py tests/test_logprobs_gpu.py tests/test_prefix_gpu.py
  group 90 check python -m lumo check
  ;;
b)
  group 120 first python bench/bench_first_request.py
  tail -5 "$out/first.log"
  group 300 prefix python bench/bench_prefix.py --trials 2
  tail -12 "$out/prefix.log"
  ;;
d)  # after the review's fixes: the prefix-cache and LLM tests again, bench_prefix with per-trial side times
  group 150 t_prefix $P tests/test_prefix_gpu.py tests/test_llm_gpu.py
  group 200 prefix python bench/bench_prefix.py --trials 3
  tail -6 "$out/prefix.log"
  ;;
p)  # the prefix-cache GPU tests alone (little device time left)
  group 150 t_prefix $P tests/test_prefix_gpu.py
  ;;
e)  # what c's t_spec left unrun (it stopped at its time limit after 9 tests, none failed)
  group 480 t_spec2 $P tests/test_gpu_spec_gpu.py -k "penalized or min_tokens or structured or (plain_steps and nvfp4)"
  ;;
c)
  group 240 t_greedy $P -s tests/test_gpu_spec_gpu.py -k "greedy_tree_equals_plain and not 27b and not drafter"
  group 240 t_spec $P tests/test_gpu_spec_gpu.py -k "structured or graph_replay or chain or seeded"
  ;;
esac
