#!/usr/bin/env bash
# What sessions 39-40 wrote without a GPU, for the next device call (one call, ~8 minutes):
# session 39's yarn RoPE (rope_kv.cu's rope_scale: the kernel and runner tests, then the speculative tests
# and greedy tree == plain, every attention launch passing it), and session 40's lazy loading (LLM packs
# each layer as it reads it: the LLM GPU tests and `lumo check`, whose reference reads lazily too).
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session40.sh")
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk PYTHONPATH=.:.gpu-deps
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
group 120 t_rope $P tests/test_rope_kv_gpu.py tests/test_runner_gpu.py
group 100 t_llm $P tests/test_llm_gpu.py
group 60 check python -m lumo check
group 160 t_greedy $P -s tests/test_gpu_spec_gpu.py -k "greedy_tree_equals_plain and not 27b and not drafter"
group 150 t_spec $P tests/test_gpu_spec_gpu.py -k "structured or graph_replay or chain or seeded"
