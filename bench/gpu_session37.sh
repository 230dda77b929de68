#!/usr/bin/env bash
# Session 37's GPU checks: session 36's (logit_bias, min_tokens: written, never run) and structured outputs
# (apply_token_mask, tree == plain under a JSON schema). llguidance is not on the GPU image: install it
# here into the ignored .gpu-deps and carry that folder with the run:
#   pip install --target .gpu-deps llguidance
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session37.sh kernels")   # then exact, engine, bench
# (four device calls, each under the 600 s a call may run; 30 device minutes if every group ran to its limit)
set -u
export PYTHONPATH=.:.gpu-deps PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=${LUMO_CACHE_DIR:-/tmp/lk}
out=${OUT:-/tmp}
source "$(dirname "$0")/gpu_group.sh"  # $P, group()
python -c "import llguidance" || echo "llguidance missing: the structured-output tests will fail"
case ${1:-kernels} in
kernels)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  group 240 t_sampling $P tests/test_sampling_gpu.py  # incl. test_apply_token_mask_matches_reference
  group 150 t_tree $P tests/test_tree_kernels_gpu.py -k "topk or accept"
  ;;
exact)
  group 560 t_exact $P -s tests/test_gpu_spec_gpu.py -k "penalized or min_tokens or structured"
  ;;
engine)
  group 150 t_runner $P tests/test_runner_gpu.py
  group 150 t_llm $P tests/test_llm_gpu.py tests/test_logprobs_gpu.py
  group 90 c_check python -m lumo check
  cat "$out/c_check.log"
  group 90 c_bench python -m lumo bench --prompt-tokens 256 --gen-tokens 64 --repeats 2 --temperature 0.7 \
    --top-k 20 --top-p 0.8 --presence-penalty 1.5
  tail -12 "$out/c_bench.log"
  ;;
bench)
  group 200 b_sampling python bench/bench_sampling.py --repeats 3
  tail -34 "$out/b_sampling.log"
  group 200 b_grammar python bench/bench_grammar.py --gpu
  tail -16 "$out/b_grammar.log"
  ;;
esac
