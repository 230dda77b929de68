#!/usr/bin/env bash
# Session 44's GPU checks (one device call): what session 43 left unrun on its final code.
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session44.sh")
# The prefix-cache GPU tests and LLM tests (warm-up with four short prompts), greedy tree == plain on the
# embedded model (50 prompts x 256 tokens, BF16 and NVFP4) and the 27B-shaped tree after a long prompt,
# both after attn_prefill left cuDNN, and bench_prefix at 32k with the default park of 32,768.
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk PYTHONPATH=.:.gpu-deps
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
group 150 t_prefix $P tests/test_prefix_gpu.py tests/test_llm_gpu.py
group 230 t_greedy $P -s tests/test_gpu_spec_gpu.py -k "test_greedy_tree_equals_plain or after_a_long_prompt"
grep -E "accepted drafts" "$out/t_greedy.log"
group 150 prefix python bench/bench_prefix.py --contexts 32768 --trials 1
tail -6 "$out/prefix.log"
