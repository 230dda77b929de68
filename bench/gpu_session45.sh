#!/usr/bin/env bash
# Session 45's GPU checks of the cp.async weight ring of nvfp4_gemv_rd (linear.cu CPR). The first two modes
# ran on an H100 (bench/results/*session45*); `h200` was to ask the same on the H200 (never lent). Session
# 46 removed the ring (docs/kernels.md, session 45): this script runs on commit 6911f41 only, as a record:
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session45.sh")       # its bits, then M = 1 times
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session45.sh ab")    # the bits again, the 27B step A/B
#   run(carry=[".gpu-deps"], command="bash bench/gpu_session45.sh h200")  # M = 1 sweep and step A/B
# The first runs the linear GPU tests that launch a ring build (bitwise against the cross-CTA kernel), then
# bench_linear's M = 1 sweep of ring depths and register bounds per slice count of the 27B shapes against
# the library default. The second reruns the ring's bit tests (their first run failed in the fixture, before
# any kernel ran: no CUDA context yet) and times the 27B decode step at 1k with linear.RD_RING = 0 / 4 (every
# M <= 8 launch of a weight of two or more slices on the ring), whole processes over two rounds, and the
# same step without its 128 block norms (GPURunner.timing_without_block_norms: wrong output, timing only:
# the most a norm folded into the GEMVs could save, docs/runner.md).
set -u
export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk PYTHONPATH=.:.gpu-deps
out=${OUT:-/tmp}
source bench/gpu_group.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${1:-}" = h200 ]; then  # the same questions on the H200 in one call, after the H100 answers
  group 150 lin python bench/bench_linear.py --m 1 --only gate "gdn qkvz" down "attn qkv" \
    --configs r1x1q4 r1x1q6 r1x1q4b1
  sed -n '/sweep: us per launch/,$p' "$out/lin.log" | grep -v "^$" | head -8
  group 380 ab python bench/ab.py --rounds 2 --variant linear.RD_RING=0 --variant linear.RD_RING=4 \
    --variant timing_without_block_norms=1 \
    -- bench/bench_decode.py --contexts 1024 --prefill --peer-layers 0 --no-profile
  tail -6 "$out/ab.log"
  exit
fi
if [ "${1:-}" = ab ]; then
  group 200 t_ring $P tests/test_linear_gpu.py -k "ring"
  group 380 ab python bench/ab.py --rounds 2 --variant linear.RD_RING=0 --variant linear.RD_RING=4 \
    --variant timing_without_block_norms=1 \
    -- bench/bench_decode.py --contexts 1024 --prefill --peer-layers 0 --no-profile
  tail -8 "$out/ab.log"
  exit
fi
group 200 t_ring $P tests/test_linear_gpu.py -k "ring or glu or conv_fused"
group 150 lin4 python bench/bench_linear.py --m 1 --only gate "gdn qkvz" \
  --configs r1x1q4 r1x1q6 r1x1q8 r1x1q12 r1x1q6b8 r1x1q8b8 r1x1q6b1 r1x1q8b1
group 150 lin8 python bench/bench_linear.py --m 1 --only "attn qkv" "out 6144" "in 5120" \
  --configs r1x1q4 r1x1q6 r1x1q8 r1x1q12 r1x1q6b5 r1x1q8b5
group 100 lin16 python bench/bench_linear.py --m 1 --only down --configs r1x1q4 r1x1q6 r1x1q8 r1x1c1q6 r1x1c1q8
group 100 linhead python bench/bench_linear.py --m 1 --only lm_head --configs r2x1q4 r2x1q6 r2x1q8 r1x1q6 r1x1q8
for f in lin4 lin8 lin16 linhead; do sed -n '/sweep: us per launch/,$p' "$out/$f.log" | grep -v "^$" | head -12; done
