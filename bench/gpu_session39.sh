#!/usr/bin/env bash
# Session 39's device calls: bench_grammar --gpu on this code and on commit c59d873's (ab_c59d873/, an
# export: mkdir ab_c59d873 && git archive c59d873 lumo bench | tar -x -C ab_c59d873; git-ignored locally
# through .git/info/exclude, so it is carried) alternately on one machine, then (`all`) the kernel tests
# last run before session 36. `next`: what session 39 wrote after its last device call (the yarn RoPE's
# kernel and runner tests, rope_kv.cu's rope_scale under every attention launch: the speculative tests and
# greedy tree == plain), then the grammar A/B.
#   run(carry=[".gpu-deps", "ab_c59d873"], command="bash bench/gpu_session39.sh [ab|all|next]")
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${1:-ab}" = next ]; then
  export PYTHONPATH=.:.gpu-deps
  group 120 t_rope $P tests/test_rope_kv_gpu.py tests/test_runner_gpu.py
  group 160 t_greedy $P -s tests/test_gpu_spec_gpu.py -k "greedy_tree_equals_plain and not 27b and not drafter"
  group 150 t_spec $P tests/test_gpu_spec_gpu.py -k "structured or graph_replay or chain or seeded"
  exit 0
fi
for round in 1 2; do
  PYTHONPATH=.:.gpu-deps group 100 b_grammar_head$round python bench/bench_grammar.py --gpu
  (cd ab_c59d873 && PYTHONPATH=.:../.gpu-deps group 100 b_grammar_c59_$round python bench/bench_grammar.py --gpu)
done
for f in b_grammar_head1 b_grammar_c59_1 b_grammar_head2 b_grammar_c59_2; do echo "== $f"; tail -6 "$out/$f.log"; done
if [ "${1:-ab}" = all ]; then
  export PYTHONPATH=.:.gpu-deps
  group 450 t_kernels $P tests/test_attention_gpu.py tests/test_conv_gpu.py tests/test_gdn_gpu.py \
    tests/test_norms_gpu.py tests/test_rope_kv_gpu.py tests/test_linear_gpu.py
fi
