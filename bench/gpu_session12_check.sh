#!/usr/bin/env bash
# Session 12's GPU checks; logs under $OUT.
#   ab:    the linear GPU tests, then the 27B decode step at 1k for the code versions under exp/ (A/B,
#          two rounds), then bench_spec.py on the working tree.
#   spec:  the speculative-engine GPU tests (~9 minutes).
#   epi:   the linear, runner, LLM and tree-kernel GPU tests, then the decode step at 1k and bench_spec.py
#          for the code versions under exp/ (A/B, two rounds).
#   last:  bench_decode.py and bench_spec.py in full, then the NVFP4 greedy tree == plain tests and the
#          27B-shaped event (a subset of `spec`, what the device time left allowed).
#   final: the linear GPU tests, bench_decode.py and bench_spec.py in full, then the runner, LLM and
#          tree-kernel GPU tests.
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=${LUMO_CACHE_DIR:-/tmp/lk}
out=${OUT:-/tmp}
t0=$SECONDS

# gpu_tests LOG SECONDS PYTEST-ARGS...: the gpu-marked tests of the working tree, their summary and failures.
gpu_tests() {
  local log=$1 limit=$2
  shift 2
  PYTHONPATH=. timeout "$limit" python -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE "$@" \
    > "$out/$log" 2>&1
  echo "$log rc=$? $((SECONDS - t0))s: $(tail -1 "$out/$log")"
  grep -E "^(FAILED|ERROR)|accepted drafts" "$out/$log" | head -20
}

# run_bench LOG SECONDS PATTERN SCRIPT ARGS...: a benchmark of the working tree and its PATTERN lines.
run_bench() {
  local log=$1 limit=$2 pattern=$3
  shift 3
  PYTHONPATH=. timeout "$limit" python "$@" > "$out/$log" 2>&1
  echo "$log rc=$? $((SECONDS - t0))s"
  grep -E "$pattern" "$out/$log"
}

# decode_ab SPEC VERSIONS...: two rounds over the code versions exp/V: the decode step at 1k, and with
# SPEC=1 also bench_spec.py's 27B spans.
decode_ab() {
  local spec=$1 round v
  shift
  for round in 1 2; do
    for v in "$@"; do
      PYTHONPATH=exp/$v timeout 100 python exp/$v/bench/bench_decode.py --contexts 1024 --prefill \
        --peer-layers 0 --no-profile > "$out/decode_${v}_$round.log" 2>&1
      echo "$v round $round rc=$? $((SECONDS - t0))s: $(grep -E '^decode' "$out/decode_${v}_$round.log")"
      [[ $spec == 1 ]] || continue
      PYTHONPATH=exp/$v timeout 100 python exp/$v/bench/bench_spec.py > "$out/spec_${v}_$round.log" 2>&1
      echo "$v round $round rc=$? $((SECONDS - t0))s: $(grep -E '^27B (draft ms|verify ms|plain)' \
        "$out/spec_${v}_$round.log" | tr -s ' ' | tr '\n' ';')"
    done
  done
}

SPANS="^27B (draft|verify|plain|tokens)"
case ${1:-ab} in
ab)
  gpu_tests t_linear.log 200 tests/test_linear_gpu.py tests/test_norms_gpu.py
  decode_ab 0 ${VERSIONS:-base glu both}
  run_bench bench_spec.log 150 "^(embedded|27B|GDN)" bench/bench_spec.py
  ;;
epi)
  gpu_tests t_epi.log 200 tests/test_linear_gpu.py tests/test_runner_gpu.py tests/test_llm_gpu.py \
    tests/test_tree_kernels_gpu.py
  decode_ab 1 ${VERSIONS:-base epi}
  ;;
last)
  run_bench bench_decode.log 150 "^(decode|prefill)" bench/bench_decode.py --peer-layers 0
  run_bench bench_spec.log 100 "$SPANS" bench/bench_spec.py
  gpu_tests t_last.log "${SPEC_S:-150}" -s tests/test_gpu_spec_gpu.py \
    -k "test_27b_shaped or (nvfp4 and (greedy_tree_equals_plain or accepted_logits or chain))"
  ;;
spec)
  gpu_tests t_spec.log 570 -s tests/test_gpu_spec_gpu.py
  ;;
final)
  gpu_tests t_linear.log 150 tests/test_linear_gpu.py
  run_bench bench_decode.log 200 "^(decode|prefill)" bench/bench_decode.py --peer-layers 0
  run_bench bench_spec.log 150 "$SPANS" bench/bench_spec.py
  gpu_tests t_rest.log 250 tests/test_runner_gpu.py tests/test_llm_gpu.py tests/test_tree_kernels_gpu.py
  ;;
esac
