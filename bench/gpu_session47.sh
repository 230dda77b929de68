#!/usr/bin/env bash
# Session 47's GPU call (carry .gpu-deps): run(carry=[".gpu-deps"], command="bash bench/gpu_session47.sh")
# 1. the prefix cache's GPU tests and the LLM's on the most-recently-used rule for parked lines (session 47);
# 2. bench/probe_stream.py, session 46's DRAM-order probe of the M = 1 GEMV's loads (its short form);
# 3. bench_prefix.py at 32k (the coding-agent table: one line now keeps the sub-agent's, not the main one's).
set -u
source bench/gpu_group.sh
session_start
group 240 t_prefix $P tests/test_prefix_gpu.py tests/test_llm_gpu.py
group 200 probe_stream python -m bench.probe_stream --work 16 --pf 2 3 --occ 0 9
cat "$out/probe_stream.log"
group 150 prefix python bench/bench_prefix.py --contexts 32768 --trials 1
tail -4 "$out/prefix.log"
