#!/usr/bin/env bash
# Session 48's GPU call (carry .gpu-deps): run(carry=[".gpu-deps"], command="bash bench/gpu_session48.sh")
# 1. the prefix cache's GPU tests and the LLM's on session 48's parking rule (the newest line, then those
#    that came back, then the longest);
# 2. the kernel files and the runner's (session 46 removed linear.cu's cp.async ring; sessions 46-47 had no
#    GPU), then `lumo generate` on the GPU.
# 3. (a second call: `bash bench/gpu_session48.sh spec`) the speculative engine's GPU tests on the current
#    kernels: greedy tree == plain on 50 prompts x 256 tokens, accepted logits and state bitwise, sampling;
#    then bench_decode at 1k and 8k (session 44's H100 table: 6.506 / 6.747 ms, 1.33x the floor).
set -u
source bench/gpu_group.sh
session_start
if [[ ${1:-} == spec ]]; then
  group 560 t_spec $P -s tests/test_gpu_spec_gpu.py
  grep -E "accepted drafts" "$out/t_spec.log"
  group 150 bench_decode python bench/bench_decode.py --contexts 1024 8192 --prefill 8192 --peer-layers 0
  grep -A6 "^## bench" "$out/bench_decode.log"
  exit
fi
group 150 t_prefix $P tests/test_prefix_gpu.py tests/test_llm_gpu.py
group 330 t_kernels $P tests/test_linear_gpu.py tests/test_norms_gpu.py tests/test_attention_gpu.py \
  tests/test_gdn_gpu.py tests/test_conv_gpu.py tests/test_rope_kv_gpu.py tests/test_sampling_gpu.py \
  tests/test_tree_kernels_gpu.py tests/test_runner_gpu.py
python -m lumo.cli generate --device cuda --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0 \
  2>&1 >/dev/null | tail -1
