#!/usr/bin/env bash
# Session 39's device call: bench_grammar --gpu on this code and on commit c59d873's (ab_c59d873/, an
# untracked export: mkdir ab_c59d873 && git archive c59d873 lumo bench | tar -x -C ab_c59d873) back to back
# on one machine, then the kernel tests last run before session 36.
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session39.sh")
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=.:.gpu-deps group 100 b_grammar_head python bench/bench_grammar.py --gpu
(cd ab_c59d873 && PYTHONPATH=.:../.gpu-deps group 100 b_grammar_c59 python bench/bench_grammar.py --gpu)
PYTHONPATH=.:.gpu-deps group 100 b_grammar_head2 python bench/bench_grammar.py --gpu
for f in b_grammar_head b_grammar_c59 b_grammar_head2; do echo "== $f"; tail -12 "$out/$f.log"; done
export PYTHONPATH=.:.gpu-deps
group 330 t_kernels $P tests/test_attention_gpu.py tests/test_conv_gpu.py tests/test_gdn_gpu.py \
  tests/test_norms_gpu.py tests/test_rope_kv_gpu.py tests/test_linear_gpu.py
