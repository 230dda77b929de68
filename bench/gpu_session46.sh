#!/usr/bin/env bash
# Session 46's GPU questions, one device call per mode (carry .gpu-deps):
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session46.sh probe")  # the M = 1 GEMV's loads alone
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session46.sh short")  # the same, fewer variants
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session46.sh ab")     # the step without its norms
# probe: bench/probe_stream.py over the 27B's M = 1 shapes at K and 2K (fixed and steady costs): the
# library packing's order against step-major and tile-major orders of the same bytes, ring depths 2..4,
# with and without a stand-in for the arithmetic, at the register ring's nine CTAs per SM, seven, and as
# many as fit.
# ab: the 27B decode step at 1k as it is and without its block norms (GPURunner.timing_without_block_norms,
# timing only: the ceiling of docs/runner.md's norm with no kernel), bench/ab.py, two rounds.
set -u
source bench/gpu_group.sh
session_start
case "${1:-}" in
  probe)
    group 300 probe_stream python -m bench.probe_stream --work 0 16 --pf 2 3 4 --occ 0 9 7
    cat "$out/probe_stream.log"
    ;;
  short)  # the same questions in about a third of the launches
    group 200 probe_stream python -m bench.probe_stream --work 16 --pf 2 3 --occ 0 9
    cat "$out/probe_stream.log"
    ;;
  ab)
    group 420 ab python bench/ab.py --rounds 2 --variant timing_without_block_norms=0 \
      --variant timing_without_block_norms=1 \
      -- bench/bench_decode.py --contexts 1024 --prefill --peer-layers 0 --no-profile
    tail -6 "$out/ab.log"
    ;;
  *) echo "usage: gpu_session46.sh probe|short|ab" && exit 2 ;;
esac
