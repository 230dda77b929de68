// Hopper warpgroup MMA (wgmma.mma_async, sm_90a only): m64 x (8 NT) x k16, bf16 in, fp32 accumulate, A
// from registers (each warp of the warpgroup holds its 16 rows in mma.sync's m16n8k16 A layout), B from
// shared memory as 8 x 8 core matrices (8 rows of 16 bytes) without swizzle, K-major. Used by the NVFP4
// GEMV at M > 16 (linear.cu, nvfp4_gemv_wg) and bench/probe_wgmma.cu. The accumulator of n8 tile j is
// c[4 j .. 4 j + 3] in mma.sync's C layout, and a k16 step gives HMMA.16816's bits.
//
// ptxas serialises every wgmma of a function (info C7514 in the NVRTC log) when other instructions touch
// an accumulator between issue and wait; wg_fence_acc pins the accumulators in place around each batch, as
// CUTLASS's warpgroup_fence_operand does. A registers: ptxas was seen (session 25) to give a later
// chunk's A values the physical registers of a wgmma still in flight after wait_group 1 (wrong results in
// one configuration); an empty asm fence does not reach ptxas, so a caller rewrites A registers only
// after wait_group 0.
#pragma once

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
