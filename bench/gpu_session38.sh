#!/usr/bin/env bash
# Session 38's GPU checks, after sessions 36-37's (gpu_session37.sh). llguidance travels in .gpu-deps:
#   pip install --target .gpu-deps llguidance
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session38.sh grammar")   # then: final
#   grammar  the draft and verify under a grammar in graph pieces (GPUSpecEngine.grammar_graphs: the spine's
#            masked selections, the verify's forward apart from its masked sampling, the host's row masks
#            computed while the forward runs), then bench_grammar's GPU table
#   final    the same (the grammar graphs now captured at their first use) and with a draft vocabulary,
#            greedy tree == plain (NVFP4, 50 x 256), LLM and prefix caching, bench_grammar's GPU table
#   next     what session 38 could not run: bench_grammar's GPU table on the final code (the ctypes mask
#            path), the structured tests again, and the kernel tests last run before session 36
set -u
export PYTHONPATH=.:.gpu-deps PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=${LUMO_CACHE_DIR:-/tmp/lk}
out=${OUT:-/tmp}
source "$(dirname "$0")/gpu_group.sh"  # $P, group()
python -c "import llguidance" || echo "llguidance missing: the structured-output tests will fail"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case ${1:-grammar} in
grammar)
  group 330 t_spec $P -s tests/test_gpu_spec_gpu.py -k "structured or graph_replay or penalized or chain"
  group 150 b_grammar python bench/bench_grammar.py --gpu
  tail -16 "$out/b_grammar.log"
  ;;
final)
  group 200 t_structured $P -s tests/test_gpu_spec_gpu.py -k "structured"  # incl. a draft vocabulary
  group 140 t_greedy $P -s tests/test_gpu_spec_gpu.py -k "greedy_tree_equals_plain and nvfp4 and not 27b and not drafter"
  group 100 t_llm $P tests/test_llm_gpu.py tests/test_prefix_gpu.py
  group 100 b_grammar python bench/bench_grammar.py --gpu
  tail -6 "$out/b_grammar.log"
  ;;
next)
  group 100 b_grammar python bench/bench_grammar.py --gpu
  tail -6 "$out/b_grammar.log"
  group 150 t_structured $P -s tests/test_gpu_spec_gpu.py -k "structured"
  group 300 t_kernels $P tests/test_attention_gpu.py tests/test_conv_gpu.py tests/test_gdn_gpu.py \
    tests/test_norms_gpu.py tests/test_rope_kv_gpu.py tests/test_linear_gpu.py
  ;;
esac
