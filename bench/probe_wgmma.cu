// Throughput of Hopper's warpgroup MMA (wgmma.mma_async m64n(8 NT)k16, bf16 -> fp32, A from registers,
// B from shared memory) in the shape an M <= 32 NVFP4 GEMV would use it (bench/probe_wgmma.py): each
// warpgroup runs ITERS "chunks"; a chunk is, for each of CH independent 64-row accumulator chains, 4
// k-steps. With DQ the A registers of every chunk are made by the GEMV's dequantisation (fp4.cuh) from a
// word that changes each chunk, into one of two register sets alternating by chunk parity (wait for the
// chunk before last (DQ 1) or for all (DQ 2), dequantise, fence, issue): the pattern a real kernel would
// run, without memory traffic. Without DQ the A registers stay fixed: the tensor pipe alone. The result is never stored
// unless it equals a value it cannot take. sm_90a only. mma_dq_peak is the same chunk loop on mma.sync (the
// kernels' instruction today): per warp CH m16 tiles, each chunk dequantised and multiplied into NT n8
// tiles of fixed B registers.
//
// lumo:test-defines NT=4 CH=2 DQ=1

#include "fp4.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

extern "C" __global__ void __launch_bounds__(128) wgmma_peak(float* out, int iters, u32 seed) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(128) unsigned char xs[4 * NT * 256];  // B of 4 k-steps: 16 x 8 NT bf16 each
  for (int i = threadIdx.x; i < 4 * NT * 256 / 4; i += 128) reinterpret_cast<u32*>(xs)[i] = 0x3F803F80u;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const u32 base = (u32)__cvta_generic_to_shared(xs);
  float acc[CH][NT * 4] = {};
  u32 a[2][CH][4][4];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[u][c][s][r] = (seed + threadIdx.x * 7 + u * 5 + c * 3 + s + r) & 0x3F803F80u;
  u32 w = seed ^ threadIdx.x;
  for (int i0 = 0; i0 < iters; i0 += 2) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#if DQ
      // DQ 1: the chunk before last, the last reader of set u, is done (what overlap could give; but ptxas
      // may hand a set's physical registers to the other set: wgmma.cuh); DQ 2: every chunk is done (safe).
      if (DQ == 2) wg_wait<0>();
      else wg_wait<1>();
      const u32 sg = scale2(w, 0x4040), sg8 = scale2(w, 0x4141);
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          u32 A, B, Cr, D;
          dequant8(w + c * 4 + s, A, B, Cr, D);
          a[u][c][s][0] = bmul2(A, sg);
          a[u][c][s][1] = bmul2(B, sg8);
          a[u][c][s][2] = bmul2(Cr, sg);
          a[u][c][s][3] = bmul2(D, sg8);
        }
      w = w * 1664525u + 1013904223u;
#else
      wg_wait<1>();
#endif
#pragma unroll
      for (int c = 0; c < CH; ++c) wg_fence_acc<NT * 4>(acc[c]);
      wg_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int c = 0; c < CH; ++c) wgmma_k16<NT>(acc[c], a[u][c][s], wg_desc(base + s * NT * 256, NT * 128, 128));
      wg_commit();
#pragma unroll
      for (int c = 0; c < CH; ++c) wg_fence_acc<NT * 4>(acc[c]);
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int c = 0; c < CH; ++c) wg_fence_acc<NT * 4>(acc[c]);
  float t = 0.f;
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int e = 0; e < NT * 4; ++e) t += acc[c][e];
  if (t == 123.f) out[threadIdx.x] = t;
#else
  __trap();  // wgmma: sm_90a only
#endif
}

extern "C" __global__ void __launch_bounds__(128) mma_dq_peak(float* out, int iters, u32 seed) {
  float acc[CH][NT][4] = {};
  const u32 b0 = 0x3F803F80u ^ threadIdx.x, b1 = b0 ^ 0x00010001u;
  u32 w = seed ^ threadIdx.x;
  for (int i = 0; i < iters; ++i) {
    const u32 sg = scale2(w, 0x4040), sg8 = scale2(w, 0x4141);
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        u32 A, B, Cr, D;
        dequant8(w + c * 4 + s, A, B, Cr, D);
        A = bmul2(A, sg), B = bmul2(B, sg8), Cr = bmul2(Cr, sg), D = bmul2(D, sg8);
#pragma unroll
        for (int j = 0; j < NT; ++j) mma_bf16(acc[c][j], A, B, Cr, D, b0 + j, b1);
      }
    w = w * 1664525u + 1013904223u;
  }
  float t = 0.f;
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int j = 0; j < NT; ++j) t += acc[c][j][0] + acc[c][j][1] + acc[c][j][2] + acc[c][j][3];
  if (t == 123.f) out[threadIdx.x] = t;
}
