// Throughput of mma.sync m16n8k16 (bf16 in, fp32 accumulate) alone: each warp runs ITERS rounds of ILP
// independent accumulator chains on register operands (bench/probe_mma.py). The result is never stored
// unless it equals a value it cannot take, so the compiler keeps every mma.
//
// lumo:test-defines ILP=8

#include "mma.cuh"

extern "C" __global__ void mma_peak(float* out, int iters) {
  float acc[ILP][4] = {};
  const unsigned a0 = threadIdx.x * 0x00010001u, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = a0 ^ 5, b1 = a0 ^ 9;
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < ILP; ++j) mma_bf16(acc[j], a0, a1, a2, a3, b0, b1);
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < ILP; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  if (s == 123.f) out[threadIdx.x] = s;
}
