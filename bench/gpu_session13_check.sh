#!/usr/bin/env bash
# Session 13's GPU checks; logs under $OUT.
#   ab:    the linear GPU tests, then the 27B decode step at 1k and bench_spec.py's 27B spans for the code
#          versions under exp/ (A/B, two rounds), then a profiled decode step of the working tree, and
#          bench_linear.py with the arguments in $LINEAR_ARGS if set.
#   last:  the bf16 linear GPU tests, the decode step at 1k for the code versions under exp/ (A/B, two
#          rounds), then bench_decode.py and bench_spec.py in full and the runner, LLM and tree-kernel GPU
#          tests on the working tree (the JSON files and per-version logs are removed: few files come back).
#   spec:  the speculative-engine GPU tests (~9 minutes).
#   final: bench_decode.py, bench_spec.py and bench_linear.py in full, then the runner, LLM and tree-kernel
#          GPU tests and the NVFP4 greedy tree == plain, accepted-state, chain and 27B-shaped spec tests.
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
  gpu_tests t_linear.log 150 tests/test_linear_gpu.py
  decode_ab 1 ${VERSIONS:-base new}
  run_bench profile.log 100 "^(decode|\\| (nvfp4|rms|attn|gdn|bf16|splitk|gated|qk|conv))" bench/bench_decode.py \
    --contexts 1024 --peer-layers 0
  if [[ -n ${LINEAR_ARGS:-} ]]; then
    # shellcheck disable=SC2086  # word splitting wanted
    run_bench bench_linear_ab.log 150 "^[a-z].* (1|8) " bench/bench_linear.py $LINEAR_ARGS
  fi
  ;;
last)
  gpu_tests t_bf16.log 100 tests/test_linear_gpu.py -k bf16
  decode_ab 0 ${VERSIONS:-base new}
  run_bench bench_decode.log 100 "^(decode|prefill)" bench/bench_decode.py --peer-layers 0
  run_bench bench_spec.log 100 "$SPANS" bench/bench_spec.py
  gpu_tests t_rest.log 100 tests/test_runner_gpu.py tests/test_llm_gpu.py tests/test_tree_kernels_gpu.py
  rm -f "$out"/*.json "$out"/decode_*.log
  ;;
spec)
  gpu_tests t_spec.log 570 -s tests/test_gpu_spec_gpu.py
  ;;
final)
  run_bench bench_decode.log 150 "^(decode|prefill)" bench/bench_decode.py --peer-layers 0
  run_bench bench_spec.log 100 "$SPANS" bench/bench_spec.py
  run_bench bench_linear.log 200 "^\\|" bench/bench_linear.py
  gpu_tests t_rest.log 150 tests/test_runner_gpu.py tests/test_llm_gpu.py tests/test_tree_kernels_gpu.py
  gpu_tests t_spec_nvfp4.log 200 -s tests/test_gpu_spec_gpu.py \
    -k "test_27b_shaped or (nvfp4 and (greedy_tree_equals_plain or accepted_logits or chain))"
  ;;
esac
