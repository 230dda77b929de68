#!/usr/bin/env bash
# Session 38's GPU checks: the draft and verify under a grammar in graph pieces (GPUSpecEngine.grammar_graphs:
# the spine's masked selections, the verify's forward apart from its masked sampling, the host's row masks
# computed while the forward runs), then bench_grammar's GPU table. llguidance travels in .gpu-deps:
#   pip install --target .gpu-deps llguidance
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session38.sh")
set -u
export PYTHONPATH=.:.gpu-deps PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=${LUMO_CACHE_DIR:-/tmp/lk}
out=${OUT:-/tmp}
source "$(dirname "$0")/gpu_group.sh"  # $P, group()
python -c "import llguidance" || echo "llguidance missing: the structured-output tests will fail"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
group 330 t_spec $P -s tests/test_gpu_spec_gpu.py -k "structured or graph_replay or penalized or chain"
group 150 b_grammar python bench/bench_grammar.py --gpu
tail -16 "$out/b_grammar.log"
