// Throughput of Hopper's warpgroup MMA (wgmma.mma_async m64n(8 NT)k16, bf16 -> fp32, A from registers,
// B from shared memory) in the shape an M <= 32 NVFP4 GEMV would use it (bench/probe_wgmma.py): each
// warpgroup runs ITERS "chunks"; a chunk is, for each of CH independent 64-row accumulator chains, 4
// k-steps. With DQ the A registers of every chunk are made by the GEMV's dequantisation (fp4.cuh) from a
// word that changes each chunk, into one of two register sets alternating by chunk parity (wait for the
// chunk before last (DQ 1) or for all (DQ 2), dequantise, fence, issue): the pattern a real kernel would
// run, without memory traffic. Without DQ the A registers stay fixed: the tensor pipe alone. The result is
// never stored unless it equals a value it cannot take. sm_90a only. mma_dq_peak is the same chunk loop on
// mma.sync (the kernels' instruction today): per warp CH m16 tiles, each chunk dequantised and multiplied
// into NT n8 tiles of fixed B registers.
//
// lumo:test-defines NT=4 CH=2 DQ=1

#include "fp4.cuh"
#include "mma.cuh"

// Hopper warpgroup MMA (wgmma.mma_async, sm_90a only): m64 x (8 NT) x k16, bf16 in, fp32 accumulate, A from
// registers (each warp of the warpgroup holds its 16 rows in mma.sync's m16n8k16 A layout), B from shared
// memory as 8 x 8 core matrices (8 rows of 16 bytes) without swizzle, K-major. ptxas serialises every wgmma
// of a function (info C7514 in the NVRTC log) when other instructions touch an accumulator between issue
// and wait; wg_fence_acc pins the accumulators around each batch, as CUTLASS's warpgroup_fence_operand
// does. ptxas was seen (session 25, the GEMV built on this, docs/kernels.md) to give a later chunk's A
// values the physical registers of a wgmma still in flight after wait_group 1; DQ 2 waits for all.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor of a B tile at `smem_addr`: start >> 4 in bits 0..13, leading (K direction) core-matrix byte
// offset >> 4 at 16, stride (N direction) byte offset >> 4 at 32, no swizzle.
__device__ __forceinline__ unsigned long long wg_desc(unsigned smem_addr, unsigned lead, unsigned stride) {
  return (unsigned long long)((smem_addr & 0x3FFFF) >> 4) | ((unsigned long long)(lead >> 4) << 16) |
         ((unsigned long long)(stride >> 4) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void wg_fence_acc(float* c) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(c[i])::"memory");
}
// c (NTW * 4 floats) += A (this warp's 16 x 16 fragment a[0..3]) x B (16 x 8 NTW at desc).
template <int NTW>
__device__ __forceinline__ void wgmma_k16(float* c, const unsigned* a, unsigned long long desc) {
  if constexpr (NTW == 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
        : "memory");
  } else if constexpr (NTW == 2) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, "
        "%12, p, 1, 1, 0;\n}\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
        : "memory");
  } else if constexpr (NTW == 3) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, "
        "{%12,%13,%14,%15}, %16, p, 1, 1, 0;\n}\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7]),
          "+f"(c[8]), "+f"(c[9]), "+f"(c[10]), "+f"(c[11])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
        : "memory");
  } else {
    static_assert(NTW == 4, "wgmma_k16: 1..4 n8 tiles");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,"
        "%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7]),
          "+f"(c[8]), "+f"(c[9]), "+f"(c[10]), "+f"(c[11]), "+f"(c[12]), "+f"(c[13]), "+f"(c[14]), "+f"(c[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
        : "memory");
  }
}
#endif

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
