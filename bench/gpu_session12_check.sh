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
P="python -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE"
t0=$SECONDS
case ${1:-ab} in
ab)
  PYTHONPATH=. timeout 200 $P tests/test_linear_gpu.py tests/test_norms_gpu.py > "$out/t_linear.log" 2>&1
  echo "linear+norms tests rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_linear.log")"
  grep -E "^(FAILED|ERROR)" "$out/t_linear.log" | head
  for round in 1 2; do
    for v in ${VERSIONS:-base glu both}; do
      PYTHONPATH=exp/$v timeout 100 python exp/$v/bench/bench_decode.py --contexts 1024 --prefill \
        --peer-layers 0 --no-profile > "$out/decode_${v}_$round.log" 2>&1
      echo "$v round $round rc=$? $((SECONDS - t0))s: $(grep -E '^decode' "$out/decode_${v}_$round.log")"
    done
  done
  PYTHONPATH=. timeout 150 python bench/bench_spec.py > "$out/bench_spec.log" 2>&1
  echo "bench_spec rc=$? $((SECONDS - t0))s"
  grep -E "^(embedded|27B|GDN)" "$out/bench_spec.log"
  ;;
epi)
  PYTHONPATH=. timeout 200 $P tests/test_linear_gpu.py tests/test_runner_gpu.py tests/test_llm_gpu.py \
    tests/test_tree_kernels_gpu.py > "$out/t_epi.log" 2>&1
  echo "linear+runner+llm+tree rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_epi.log")"
  grep -E "^(FAILED|ERROR)" "$out/t_epi.log" | head
  for round in 1 2; do
    for v in ${VERSIONS:-base epi}; do
      PYTHONPATH=exp/$v timeout 100 python exp/$v/bench/bench_decode.py --contexts 1024 --prefill \
        --peer-layers 0 --no-profile > "$out/decode_${v}_$round.log" 2>&1
      echo "$v round $round rc=$? $((SECONDS - t0))s: $(grep -E '^decode' "$out/decode_${v}_$round.log")"
      PYTHONPATH=exp/$v timeout 100 python exp/$v/bench/bench_spec.py > "$out/spec_${v}_$round.log" 2>&1
      echo "$v round $round rc=$? $((SECONDS - t0))s: $(grep -E '^27B (draft ms|verify ms|plain)' "$out/spec_${v}_$round.log" | tr -s ' ' | tr '\n' ';')"
    done
  done
  ;;
last)
  PYTHONPATH=. timeout 150 python bench/bench_decode.py --peer-layers 0 > "$out/bench_decode.log" 2>&1
  echo "bench_decode rc=$? $((SECONDS - t0))s"
  grep -E "^(decode|prefill)" "$out/bench_decode.log"
  PYTHONPATH=. timeout 100 python bench/bench_spec.py > "$out/bench_spec.log" 2>&1
  echo "bench_spec rc=$? $((SECONDS - t0))s"
  grep -E "^27B (draft|verify|plain|tokens)" "$out/bench_spec.log"
  PYTHONPATH=. timeout ${SPEC_S:-150} $P -s tests/test_gpu_spec_gpu.py \
    -k "test_27b_shaped or (nvfp4 and (greedy_tree_equals_plain or accepted_logits or chain))" > "$out/t_last.log" 2>&1
  echo "spec subset rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_last.log")"
  grep -E "^(FAILED|ERROR)|accepted drafts" "$out/t_last.log"
  ;;
spec)
  PYTHONPATH=. timeout 570 $P -s tests/test_gpu_spec_gpu.py > "$out/t_spec.log" 2>&1
  echo "spec rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_spec.log")"
  grep -E "^(FAILED|ERROR)|accepted drafts" "$out/t_spec.log"
  ;;
final)
  PYTHONPATH=. timeout 150 $P tests/test_linear_gpu.py > "$out/t_linear.log" 2>&1
  echo "linear tests rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_linear.log")"
  grep -E "^(FAILED|ERROR)" "$out/t_linear.log" | head
  PYTHONPATH=. timeout 200 python bench/bench_decode.py --peer-layers 0 > "$out/bench_decode.log" 2>&1
  echo "bench_decode rc=$? $((SECONDS - t0))s"
  grep -E "^(decode|prefill)" "$out/bench_decode.log"
  PYTHONPATH=. timeout 150 python bench/bench_spec.py > "$out/bench_spec.log" 2>&1
  echo "bench_spec rc=$? $((SECONDS - t0))s"
  grep -E "^27B (draft|verify|plain|tokens)" "$out/bench_spec.log"
  PYTHONPATH=. timeout 250 $P tests/test_runner_gpu.py tests/test_llm_gpu.py tests/test_tree_kernels_gpu.py \
    > "$out/t_rest.log" 2>&1
  echo "runner+llm+tree rc=$? $((SECONDS - t0))s: $(tail -1 "$out/t_rest.log")"
  grep -E "^(FAILED|ERROR)" "$out/t_rest.log" | head
  ;;
esac
