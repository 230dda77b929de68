// Weight GEMV/GEMM for M <= 32 activation rows (decode, tree verification) and the prefill dequant.
//
// out[m, n] = gs[n] * sum_k x[m, k] * W[n, k], bf16 in/out, fp32 accumulate on mma.sync m16n8k16 bf16.
// Weights are the mma A operand (16 weight rows per m16 tile), activations the B operand (8 rows per n8
// tile). Batch invariance: a row's result is the same whatever M is, because every mma column is computed
// independently and the K order (mma k-steps, then chunks in order, then split-K slices in slice order)
// depends only on (N, K) and the packing, never on M. NT (n8 tiles) only changes how many columns are
// computed.
//
// K permutation: in chunk c (64 columns) lane (g, t) handles columns 64c + 16t .. 64c + 16t + 15, mma
// k-step s taking 16t + 4s + {0,1} as mma k {2t, 2t+1} and 16t + 4s + {2,3} as mma k {2t+8, 2t+9}. So a
// lane's activations are 32 contiguous bytes, and its weights of a chunk lie in one NVFP4 scale block.
//
// NVFP4 work split (nvfp4_gemv): a CTA owns RGW row groups (MT / TPW warps each, TPW m16 tiles per
// warp) and one split-K slice; every warp walks the slice's chunks in order. The activation tile of a
// chunk is loaded once per CTA into shared memory and read by all the CTA's warps (x traffic from L2 is
// 1/RGW of one-row-group-per-CTA). RGW and TPW are launch choices only: they never change a row's K order.
//
// Packed NVFP4 (lumo/kernels/linear.py:pack_nvfp4), MT m16 tiles per row group (16*MT rows):
//   qw [RG][C][MT][32 lanes][16 B]: lane (g, t) word s (4 B) holds rows g, g+8, columns 16t + 4s + {0..3}
//       as the mma A registers (A, B, C, D) = (row g k-lo, row g+8 k-lo, row g k-hi, row g+8 k-hi), each a
//       bf16 pair. Code bits sit where `dequant8` finds them: register A = w & MASK, B = rotl(w, 4) & MASK,
//       C = rotl(w, 10) & MASK, D = (rotl(w, 6) & m-bits) | (rotl(w, 30) & rest) with MASK = 0x81C081C0:
//       sign to bf16 bit 15, (e1 e0 m) to bits 8..6, i.e. the bf16 of (E2M1 value) * 2^-126 (a subnormal
//       for +-0.5). linear.py:_bit_positions is the same table.
//   qs [RG][C][MT][32 lanes] u16: scale byte of row g (low) and row g+8 (high) for block 4c + t, stored as
//       e5m3 such that bf16 bits = (byte << 4) + (117 << 7) are the exact e4m3 value; the kernel adds
//       119 to the exponent (scale * 2^119), so one exact HMUL2 gives E2M1 * scale * 2^-7, and 2^7 goes
//       into the fp32 epilogue with gs.
//   gs [N_pad] f32: weight_scale_2 per row (fused shards keep their own).
//
// In-CTA split-K (nvfp4_gemv_rd): one CTA (or a cluster of RDCL CTAs) holds every split-K slice of MTW m16
// tiles, a warp per slice loading its operands straight into registers, and sums the slices in slice order
// in shared memory with the same fp32 operations as splitk_reduce. Same bits as nvfp4_gemv + splitk_reduce,
// so which of the two runs is a launch choice; it saves the partial buffer's round trip and the second
// launch.
//
// Each extern "C" kernel sits in `#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_<name>)`: linear.py compiles
// one kernel per NVRTC call (each launch configuration is its own compile), CI compiles them all.
//
// lumo:test-defines NT=1 STAGES=4 RGW=4 MTW=1 KSW=16 PF=4
// lumo:test-defines NT=4 STAGES=3 RGW=8 MTW=4 KSW=8 PF=2
// lumo:test-defines NT=2 STAGES=3 RGW=4 MTW=2 KSW=4 PF=3 LUMO_PROBE=1
// lumo:test-defines NT=1 STAGES=5 RGW=2 MTW=1 KSW=2 PF=2 LUMO_PROBE=2
// lumo:test-defines NT=1 STAGES=4 RGW=4 MTW=2 KSW=4 PF=2 LUMO_PROBE=3
// lumo:test-defines NT=4 STAGES=3 RGW=4 MTW=2 KSW=4 PF=2 LUMO_PROBE=5
// lumo:test-defines NT=4 STAGES=3 RGW=4 TPW=1 MTW=1 KSW=4 PF=2
// lumo:test-defines NT=2 STAGES=4 RGW=2 TPW=2 MTW=1 KSW=4 PF=2
// lumo:test-defines NT=1 MTW=1 KSW=8 PF=3 RD_MINB=4
// lumo:test-defines NT=4 MTW=2 KSW=4 PF=2 GLU=1
// lumo:test-defines NT=1 MTW=1 KSW=4 PF=2 CONV=4
// lumo:test-defines NT=1 MTW=2 KSW=4 PF=2 RDCL=2 CONV=3
// lumo:test-defines NT=4 MTW=2 PF=3 SXW=8
// lumo:test-defines NT=1 MT=1 RPF=2 LUMO_ONLY=1 LUMO_ONLY_bf16_gemv=1
// lumo:test-defines NT=4 MT=2 RPF=2 XPF=1 LUMO_ONLY=1 LUMO_ONLY_bf16_gemv=1
// lumo:test-defines NT=4 KW=4 BPF=2
// lumo:test-defines NT=1 MTW=1 KSW=8 PF=2 RDCL=2 RD_MINB=5
// lumo:test-defines NT=1 MTW=1 KSW=4 PF=2 LUMO_TRACE=4096 LUMO_TRACE_CAP=16
// lumo:test-defines NT=1 MTW=1 KSW=8 PF=2 STG=1 LUMO_ONLY=1 LUMO_ONLY_nvfp4_gemv_rd=1
// lumo:test-defines NT=4 MTW=2 KSW=4 PF=2 RDCL=2 STG=1 LUMO_ONLY=1 LUMO_ONLY_nvfp4_gemv_rd=1

#include <cuda_bf16.h>

#include "act.cuh"
#include "fp4.cuh"
#include "mma.cuh"
#include "pdl.cuh"

#ifndef NT
#define NT 4  // n8 tiles of activation rows: M <= 8 * NT
#endif
#ifndef MT
#define MT 4  // m16 tiles per warp; the packer's row-group size is 16 * MT
#endif
#ifndef STAGES
#define STAGES 4  // cp.async pipeline depth per warp
#endif
#ifndef KW
#define KW 4  // bf16_gemv: accumulators of a slice (its chunks round-robin), a warp each (part of the K order)
#endif
#ifndef RGW
#define RGW 4  // nvfp4_gemv: row groups per CTA sharing one activation tile
#endif
#ifndef TPW
#define TPW MT  // nvfp4_gemv: m16 tiles per warp (a divisor of MT): MT / TPW warps per row group
#endif
#define GEMV_WARPS (RGW * (MT / TPW))
#ifndef MTW
#define MTW 2  // nvfp4_gemv_rd: m16 tiles per warp (a divisor of MT)
#endif

// Measurement probes (bench/probe_linear.py only; the library never sets it): LUMO_PROBE 1 skips the
// dequant + mma (the memory pipeline alone; nvfp4_gemv_rd then drops its activation loads too), 2 reads
// every chunk's weights from the first two chunks of its row group (nvfp4_gemv) or split-K slice
// (nvfp4_gemv_rd): L2-resident, the arithmetic and the pipeline without DRAM traffic. 3 computes the
// dequant's shifts as integer products (same bits, another pipe: see dequant8). 4 (nvfp4_gemv_rd) reads
// every chunk's activations from its slice's first chunk (L1-resident: no activation traffic beyond L1),
// 5 is 2 and 4 together.
#ifndef LUMO_PROBE
#define LUMO_PROBE 0
#endif
#define PROBE_L2W (LUMO_PROBE == 2 || LUMO_PROBE == 5)
#define PROBE_X0 (LUMO_PROBE == 4 || LUMO_PROBE == 5)
#define PROBE_CHUNK(c) (PROBE_L2W ? ((c) & 1) : (c))

// Timeline trace (bench/trace_step.py only): nvfp4_gemv_rd's CTAs record their start, the return of their
// pdl_wait, the end of warp 0's main loop and their end (trace.cuh). Other builds: nothing.
#include "trace.cuh"

typedef __nv_bfloat16 bf16;

// Per-warp shared-memory stage: weights, then scales (NVFP4 only), then activations.
#define Q_BYTES (MT * 512)
#define S_BYTES (MT * 64)
#define X_BYTES (NT * 1024)
#define FP4_STAGE (X_BYTES + RGW * (Q_BYTES + S_BYTES))  // per CTA: x tile, then each row group's weights

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes, bool l1) {
  u32 s = (u32)__cvta_generic_to_shared(dst);
  if (l1) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// One m16 tile's chunk: its 16 packed bytes (4 k-steps of this lane's A fragments) and scale pair are
// dequantised and multiplied into the NT n8 tiles of activations xv (this lane's 32 bytes per tile).
__device__ __forceinline__ void fp4_tile_mma(float (*acc)[4], const uint4& wv, u32 sv, const uint4 (*xv)[2]) {
  if (LUMO_PROBE == 1) return;
  const u32 sg = scale2(sv, 0x4040), sg8 = scale2(sv, 0x4141);
  const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    u32 A, B, Cr, D;
    dequant8(words[s], A, B, Cr, D);
    A = bmul2(A, sg);
    B = bmul2(B, sg8);
    Cr = bmul2(Cr, sg);
    D = bmul2(D, sg8);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const u32* xw = reinterpret_cast<const u32*>(&xv[j][s >> 1]);
      mma_bf16(acc[j], A, B, Cr, D, xw[(s & 1) * 2], xw[(s & 1) * 2 + 1]);
    }
  }
}

template <int TILES>
__device__ __forceinline__ void store_tile(float (*acc)[NT][4], const float* __restrict__ gs,
                                           bf16* __restrict__ out, float* __restrict__ partial, int M,
                                           int N, int row0, int lane, float unscale = 1.0f) {
  const int g = lane >> 2, t = lane & 3;
  const bool split = gridDim.y > 1;
  float* part = partial + (size_t)blockIdx.y * M * N;
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = row0 + 16 * i + g + 8 * h;
      if (n >= N) continue;
      const float scale = gs ? gs[n] : 1.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = 8 * j + 2 * t + e;
          if (m >= M) continue;
          const float v = acc[i][j][2 * h + e] * unscale;  // a power of two: exact
          if (split) {
            part[(size_t)m * N + n] = v;
          } else {
            out[(size_t)m * N + n] = __float2bfloat16_rn(v * scale);
          }
        }
      }
    }
  }
}

// Sum the W warps' accumulators (TILES m16 tiles each) in warp order into warp 0's registers (a = acc_0,
// a += acc_w), through (W - 1) * TILES * NT * 512 bytes of shared memory (reused after the pipeline).
template <int W, int TILES>
__device__ __forceinline__ void reduce_warps(float (*acc)[NT][4], char* smem, int warp, int lane) {
  float* red = reinterpret_cast<float*>(smem);
  __syncthreads();  // every warp is done with its ring
  if (warp > 0) {
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(((warp - 1) * TILES + i) * NT + j) * 4 * 32 + e * 32 + lane] = acc[i][j][e];
  }
  __syncthreads();
  if (warp == 0) {
    for (int w = 1; w < W; ++w)
#pragma unroll
      for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] += red[(((w - 1) * TILES + i) * NT + j) * 4 * 32 + e * 32 + lane];
  }
}

// Thread-block clusters (sm_90+): barrier and a 16-byte read of another CTA's shared memory.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ float4 ld_cluster4(const float* local, u32 rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u32 remote, a = (u32)__cvta_generic_to_shared(local);
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
#endif
  return v;
}

__device__ __forceinline__ float ld_cluster1(const float* local, u32 rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u32 remote, a = (u32)__cvta_generic_to_shared(local);
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}
__device__ __forceinline__ u32 cluster_rank() {  // 0 outside a cluster launch
  u32 rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
  return rank;
}

// Epilogue of the cluster-reduced split-K kernel (nvfp4_gemv_cl): CTA s of the cluster (slice
// s) puts the partials p_s = acc * unscale of its W row groups (rg0 + w) in its shared memory as
// red[w][i][j][e][lane]: warp v < W * MT / TILES holds the TILES m16 tiles from v * TILES on; after a cluster
// barrier CTA s sums the s-th share of the entries over the slices in slice order (a = p_0, a += p_1, ...:
// splitk_reduce's operations) and stores bf16(a * gs[n]) (gs null: 1); a second barrier keeps every CTA's
// shared memory alive until all reads are done. 4 consecutive lanes share g (lane = 4g + t), so one 16-byte
// read covers t = 0..3 of one (w, i, j, e). Called by every thread of the CTA.
template <int W, int TILES>
__device__ __forceinline__ void cluster_reduce_store(float (*acc)[NT][4], const float* __restrict__ gs,
                                                     float unscale, int rg0, bf16* __restrict__ out, int M,
                                                     int N, int lane, int warp) {
  extern __shared__ uint4 smem[];
  float* red = reinterpret_cast<float*>(smem);  // W * MT * NT * 512 bytes (the ring is done)
  const int S = gridDim.y;                      // the cluster: the S slices of this row-group tile
  const u32 rank = cluster_rank();
  __syncthreads();  // every warp is done with the ring
  if (warp < W * MT / TILES)
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          red[(((warp * TILES + i) * NT + j) * 4 + e) * 32 + lane] = acc[i][j][e] * unscale;
  cluster_sync();
  constexpr int Q = W * MT * NT * 4 * 8;  // 16-byte groups (w, i, j, e, g)
  const int per = (Q + S - 1) / S;
  const int q1 = min(Q, (int)(rank + 1) * per);
  for (int q = rank * per + threadIdx.x; q < q1; q += blockDim.x) {
    float4 a = ld_cluster4(red + 4 * q, 0);
    for (int s = 1; s < S; ++s) {
      const float4 b = ld_cluster4(red + 4 * q, s);
      a.x += b.x;
      a.y += b.y;
      a.z += b.z;
      a.w += b.w;
    }
    const int g = q & 7, e = (q >> 3) & 3, j = (q >> 5) % NT, i = (q >> 5) / NT % MT, w = (q >> 5) / NT / MT;
    const int n = (rg0 + w) * MT * 16 + 16 * i + g + 8 * (e >> 1);
    if (n >= N) continue;
    const float scale = gs ? gs[n] : 1.0f;
    const float v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int m = 8 * j + 2 * t + (e & 1);
      if (m < M) out[(size_t)m * N + n] = __float2bfloat16_rn(v[t] * scale);
    }
  }
  cluster_sync();  // no CTA leaves (and frees its shared memory) while another still reads it
}

// grid (ceil(RG / RGW), S), block 32 * GEMV_WARPS, dynamic smem STAGES * FP4_STAGE.
// Split s covers chunks [s * cps, min(C, (s + 1) * cps)); with S > 1 it writes fp32 partials [S, M, N]
// that splitk_reduce sums. (A fused finish, where the last CTA of a row tile to arrive sums the slices,
// measured slower on the H200: 7.3 ms of GEMV per 27B decode step against 5.9 + 0.66 ms for GEMV +
// reduce; the fence, arrival atomic and serial tail of every launch cost more than the second launch.)
// One cp.async ring per CTA: stage i holds chunk c0 + i's activation tile (loaded by all threads) and each
// warp's weights + scales for it (loaded by that warp). One __syncthreads per chunk.
template <bool kCluster>
__device__ __forceinline__ void nvfp4_gemv_body(const uint4* __restrict__ qw, const unsigned short* __restrict__ qs,
                                                const float* __restrict__ gs, const bf16* __restrict__ x,
                                                bf16* __restrict__ out, float* __restrict__ partial, int M,
                                                int N, int K, int RG, int C, int cps) {
  extern __shared__ uint4 smem[];
  char* ring = reinterpret_cast<char*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rgl = warp / (MT / TPW), p0 = warp % (MT / TPW) * TPW;  // row group in the CTA, first tile
  const int rg = blockIdx.x * RGW + rgl;
  const bool active = rg < RG;  // the last CTA may have idle warps (they still load x and sync)
  // This warp's tiles p0 .. p0 + TPW - 1 of row group rg: global chunk c at + c * Q_BYTES (S_BYTES).
  const char* wsrc = reinterpret_cast<const char*>(qw) + (size_t)rg * C * Q_BYTES + p0 * 512;
  const char* ssrc = reinterpret_cast<const char*>(qs) + (size_t)rg * C * S_BYTES + p0 * 64;
  const int c0 = blockIdx.y * cps;
  const int nc = max(0, min(C, c0 + cps) - c0);
  const int wofs = X_BYTES + rgl * (Q_BYTES + S_BYTES);  // the row group's weights, then its scales

  auto issue_w = [&](int i) {  // this warp's weights + scales of chunk c0 + i: no earlier kernel writes them
    char* st = ring + (i % STAGES) * FP4_STAGE;
    const int c = PROBE_CHUNK(c0 + i);
    if (active) {
#pragma unroll
      for (int p = 0; p < TPW; ++p)
        cp_async16(st + wofs + ((p0 + p) * 32 + lane) * 16, wsrc + (size_t)c * Q_BYTES + (p * 32 + lane) * 16,
                   16, false);
      if (lane < TPW * 4)
        cp_async16(st + wofs + Q_BYTES + p0 * 64 + lane * 16, ssrc + (size_t)c * S_BYTES + lane * 16, 16, false);
    }
  };
  auto issue_x = [&](int i) {  // the activation tile of chunk c0 + i (all threads)
    char* st = ring + (i % STAGES) * FP4_STAGE;
    const int c = c0 + i;
    // x tile: NT * 64 pieces of 16 B; piece (j, h, lane') = row 8j + g', columns 64c + 16t' + 8h.
    constexpr int XITER = (NT * 64 + GEMV_WARPS * 32 - 1) / (GEMV_WARPS * 32);
#pragma unroll
    for (int r = 0; r < XITER; ++r) {
      const int q = threadIdx.x + r * GEMV_WARPS * 32;
      if ((NT * 64) % (GEMV_WARPS * 32) != 0 && q >= NT * 64) break;
      const int l = q & 31, j = q >> 6, h = (q >> 5) & 1;
      const int row = 8 * j + (l >> 2), col = c * 64 + 16 * (l & 3) + 8 * h;
      const bool ok = row < M && col < K;
      cp_async16(st + q * 16, ok ? x + (size_t)row * K + col : x, ok ? 16 : 0, true);
    }
  };

  float acc[TPW][NT][4] = {};

  // Prologue: the first stages' weights go out before the wait for the previous kernel (PDL), their
  // activations after it. Group 0 holds all prologue weights and x of stage 0, group i x of stage i.
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i)
    if (i < nc) issue_w(i);
  pdl_wait();
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < nc) issue_x(i);
    cp_async_commit();
  }
  for (int i = 0; i < nc; ++i) {
    cp_async_wait<STAGES - 2>();  // chunk i has landed (this thread's copies)
    __syncthreads();              // ... everyone's, and everyone is done with chunk i - 1's stage
    if (i + STAGES - 1 < nc) {    // refills chunk i - 1's stage
      issue_w(i + STAGES - 1);
      issue_x(i + STAGES - 1);
    }
    cp_async_commit();
    if (!active) continue;
    const char* st = ring + (i % STAGES) * FP4_STAGE;
    uint4 xv[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) xv[j][h] = *reinterpret_cast<const uint4*>(st + ((j * 2 + h) * 32 + lane) * 16);
#pragma unroll
    for (int p = 0; p < TPW; ++p) {
      const uint4 wv = *reinterpret_cast<const uint4*>(st + wofs + ((p0 + p) * 32 + lane) * 16);
      const u32 sv = *reinterpret_cast<const unsigned short*>(st + wofs + Q_BYTES + ((p0 + p) * 32 + lane) * 2);
      fp4_tile_mma(acc[p], wv, sv, xv);
    }
  }
  cp_async_wait<0>();
  pdl_trigger();  // the next kernel's prologue may overlap this one's stores and split-K finish
  if (kCluster) {
    cluster_reduce_store<RGW, TPW>(acc, gs, DQ_UNSCALE, blockIdx.x * RGW, out, M, N, lane, warp);
  } else if (active) {
    store_tile<TPW>(acc, gs, out, partial, M, N, (rg * MT + p0) * 16, lane, DQ_UNSCALE);
  }
}

#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_nvfp4_gemv)
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    nvfp4_gemv(const uint4* __restrict__ qw, const unsigned short* __restrict__ qs,
               const float* __restrict__ gs, const bf16* __restrict__ x, bf16* __restrict__ out,
               float* __restrict__ partial, int M, int N, int K, int RG, int C, int cps) {
  nvfp4_gemv_body<false>(qw, qs, gs, x, out, partial, M, N, K, RG, C, cps);
}
#endif

// The same GEMV launched as clusters of the S split-K CTAs of a row-group tile (cluster dims (1, S, 1),
// sm_90+): the slices' partials stay in shared memory and the cluster sums them through distributed
// shared memory, so there is no partial buffer and no second launch. Bitwise nvfp4_gemv + splitk_reduce.
#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_nvfp4_gemv_cl)
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    nvfp4_gemv_cl(const uint4* __restrict__ qw, const unsigned short* __restrict__ qs,
                  const float* __restrict__ gs, const bf16* __restrict__ x, bf16* __restrict__ out, int M,
                  int N, int K, int RG, int C, int cps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  nvfp4_gemv_body<true>(qw, qs, gs, x, out, nullptr, M, N, K, RG, C, cps);
#else
  __trap();  // clusters need sm_90; linear.py never launches this below
#endif
}
#endif

#ifndef KSW
#define KSW 8  // nvfp4_gemv_rd: warps per CTA = split-K slices of the weight held by one CTA
#endif
#ifndef RDCL
#define RDCL 1  // nvfp4_gemv_rd: CTAs per thread-block cluster (sm_90+); the weight has KSW * RDCL slices
#endif
#ifndef GLU
#define GLU 0  // nvfp4_gemv_rd: 1 for an MLP's [gate | up] packed for the fused SwiGLU (see below)
#endif
#ifndef CONV
#define CONV 0  // nvfp4_gemv_rd: the GDN conv's kernel size KC to fuse conv_decode into the epilogue (below)
#endif
static_assert(!(CONV && GLU), "CONV and GLU are two different epilogues");
#if CONV
#include "conv.cuh"
#endif

// The decode conv fused into the epilogue (CONV = KC > 0; one activation row, M == 1, the launcher's rule):
// the GDN q/k/v/z projection's first C output channels are the conv's pre-conv inputs. The lane that
// stores channel n < C = cv.C also runs conv_decode's step for it (conv.cuh, conv_decode_channel: the same
// function conv_decode calls on the same bf16 value): y[n] = silu(conv(state window, out[n])), the state
// shifted with out[n] appended. Channel n is stored by exactly one lane, so its state has one reader and
// writer. The channel's conv weights and window are loaded before the slices' barrier (an L2 request for
// them before pdl_wait): no kernel of a step writes this layer's conv state but this one, and under PDL
// every earlier kernel has completed once pdl_wait returns. out[n] itself is still stored (the raw
// projection, as without CONV).
struct ConvEpi {
  const bf16* w;  // [C, CONV] conv weights
  bf16* state;    // [C, CONV - 1] pre-conv window, oldest first (updated)
  bf16* y;        // [C] post-conv, SiLU'd
  int C;
};
#if CONV
#define CONV_PARAMS , const bf16 *__restrict__ conv_w, bf16 *__restrict__ conv_state, bf16 *__restrict__ conv_y, \
                      int conv_c
#define CONV_EPI , ConvEpi{conv_w, conv_state, conv_y, conv_c}
#else
#define CONV_PARAMS
#define CONV_EPI
#endif

// A lane's two channels n = row0 + g + 8h of one m16 tile (stored by the lanes with t == 0 at M == 1):
// their conv weights and state windows (channels >= C: nothing).
struct ConvPre {
  float w[2][CONV > 0 ? CONV : 1];
  bf16 keep[2][CONV > 1 ? CONV - 1 : 1];
};
__device__ __forceinline__ void conv_preload(const ConvEpi& cv, int row0, int lane, ConvPre& p) {
#if CONV
  const int g = lane >> 2;
  if ((lane & 3) != 0) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = row0 + g + 8 * h;
    if (n >= cv.C) continue;
#pragma unroll
    for (int j = 0; j < CONV; ++j) p.w[h][j] = __bfloat162float(cv.w[(size_t)n * CONV + j]);
#pragma unroll
    for (int j = 0; j < CONV - 1; ++j) p.keep[h][j] = cv.state[(size_t)n * (CONV - 1) + j];
  }
#endif
}
__device__ __forceinline__ void conv_prefetch(const ConvEpi& cv, int row0, int lane) {  // before pdl_wait
#if CONV
  const int n = row0 + 8 * (lane >> 3);  // lanes 0 and 8: the tile's two 8-channel halves
  if ((lane & 7) == 0 && lane < 16 && n < cv.C) {
    pdl_prefetch_l2(cv.w + (size_t)n * CONV);
    pdl_prefetch_l2(cv.state + (size_t)n * (CONV - 1));
  }
#endif
}

// Epilogue of the in-CTA split-K kernel (nvfp4_gemv_rd): warp w of cluster rank r holds slice s = r * KSW
// + w's accumulators of MTW m16 tiles from tile0 on (RDCL = 1: one CTA, r = 0). Every warp puts its slice
// partial p_s = acc_s * 2^7 (as nvfp4_gemv stores it) in its CTA's shared memory; then the (tile, n8 tile)
// pairs are shared out among the cluster's warps (pair q to slice q % S), and each sums its pairs over the
// slices in slice order (a = p_0, a += p_s: splitk_reduce's operations; another CTA's partials through
// distributed shared memory) and stores bf16(a * gs[n]). Needs KSW * MTW * NT * 512 bytes of dynamic shared
// memory per CTA.
//
// GLU: the weight is an MLP's [gate | up] packed by pack_fused(..., glu=True): rows g and g + 8 of m16
// tile T are gate and up row 8T + g. Lane (g, t) then holds both halves of output 8T + g, rounds each to
// bf16 as the plain store would, and stores act = bf16(silu(gate) * up) with silu_mul's arithmetic
// (act.cuh): the bits of this GEMV unfused followed by silu_mul, in one launch. N is then I, the MLP's
// intermediate size (the output's width).
__device__ __forceinline__ void slices_reduce_store(float (*acc)[NT][4], const float* __restrict__ gs,
                                                bf16* __restrict__ out, int M, int N, int tile0, int warp,
                                                int lane, const ConvEpi& cv = ConvEpi{}) {
  extern __shared__ uint4 smem[];
  float* red = reinterpret_cast<float*>(smem);  // [warp][tile i][n8 tile j][e][lane]
  const int g = lane >> 2, t = lane & 3;
  const int slice = (RDCL > 1 ? (int)cluster_rank() * KSW : 0) + warp;
  ConvPre pre;  // CONV: the conv operands of this warp's first tile, loaded while the slices meet
  if (CONV && slice < MTW * NT) conv_preload(cv, (tile0 + slice / NT) * 16, lane, pre);
#pragma unroll
  for (int i = 0; i < MTW; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)  // never fused with the sum below
        red[(((warp * MTW + i) * NT + j) * 4 + e) * 32 + lane] = __fmul_rn(acc[i][j][e], DQ_UNSCALE);
  if (RDCL > 1)
    cluster_sync();
  else
    __syncthreads();
  // Slice s's partial of entry (i, j, e): in CTA s / KSW of the cluster, warp s % KSW.
  auto part = [&](int s, int i, int j, int e) {
    const float* p = red + ((((s % KSW) * MTW + i) * NT + j) * 4 + e) * 32 + lane;
    return RDCL > 1 ? ld_cluster1(p, s / KSW) : *p;
  };
  for (int q = slice; q < MTW * NT; q += KSW * RDCL) {
    const int i = q / NT, j = q % NT;
    float a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = part(0, i, j, e);
#if RDCL > 1
#pragma unroll 4  // 4 slices' remote loads in flight: fully unrolled they took 96 registers (session 13)
#endif
    for (int s = 1; s < KSW * RDCL; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] += part(s, i, j, e);
#if GLU
    const int o = (tile0 + i) * 8 + g;
    if (o >= N) continue;
    const float sg = gs[(tile0 + i) * 16 + g], su = gs[(tile0 + i) * 16 + g + 8];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 8 * j + 2 * t + e;
      if (m < M)
        out[(size_t)m * N + o] = __float2bfloat16_rn(silu_mul1(round_bf16(a[e] * sg), round_bf16(a[2 + e] * su)));
    }
#else
#if CONV
    if (q != slice) conv_preload(cv, (tile0 + i) * 16, lane, pre);
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = (tile0 + i) * 16 + g + 8 * h;
      if (n >= N) continue;
      const float scale = gs[n];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = 8 * j + 2 * t + e;
        if (m >= M) continue;
        const bf16 v = __float2bfloat16_rn(a[2 * h + e] * scale);
        out[(size_t)m * N + n] = v;
#if CONV
        if (m == 0 && n < cv.C)
          conv_decode_channel<CONV>(pre.w[h], pre.keep[h], v, cv.y + n, cv.state + (size_t)n * (CONV - 1));
#endif
      }
    }
#endif
  }
  if (RDCL > 1) cluster_sync();  // no CTA leaves (and frees its shared memory) while another still reads it
}

// Register-direct in-CTA split-K (nvfp4_gemv_rd, M <= 8 * NT). grid (RG * MT / MTW, RDCL), block 32 * KSW
// with KSW * RDCL = S: warp w of CTA (b, r) walks split-K slice s = r * KSW + w (chunks [s * cps, min(C, (s +
// 1) * cps))) of the CTA's MTW m16 tiles. RDCL > 1 (sm_90+): the S slices of a tile are spread over a
// cluster of RDCL CTAs of fewer warps each (smaller CTAs fill the SMs' slots better where a whole-slice CTA
// leaves a last wave mostly empty) and summed through distributed shared memory in the same order.
// The packed layout already gives each lane its own 16 bytes of A fragments per m16 tile, so every lane
// loads its weights, scale pair and B fragments (row 8j + g of x, 32 bytes per n8 tile) straight into
// registers, PF chunks ahead (a register ring of PF slots, indexed at compile time by unrolling the loop PF
// times). No cp.async, no shared memory and no barrier until the epilogue. It replaced a cp.async-ring
// version of the same split (nvfp4_gemv_ks, session 3): the H200 profile showed these GEMVs issue-bound
// (the same time with the weights served from L2), and ~230 of that kernel's ~290 instructions per chunk
// and warp were ring bookkeeping; this loop has ~72 (MTW 1, PF 3, sm_90: 216 per three chunks, of which 52
// per chunk are the dequant). Its steady state has no branch and no bounds check: the loads address the chunk
// by a compile-time offset from pointers moved once per PF chunks (session 8: 84 -> 72 instructions per
// chunk; the H200's gate+up GEMV 31.3 -> 28.3 us at M = 1 and 55.1 -> 48.2 at M = 32, down 21.5 -> 17.3 at
// M = 1). Dynamic smem: KSW * MTW * NT * 512 bytes per CTA; STG builds (below) also hold every warp's slice
// there (KSW * cps * MTW * 576 bytes), read by the same ring.
#ifndef PF
#define PF 4  // nvfp4_gemv_rd: chunks in flight per warp
#endif
#ifndef RD_MINB
#define RD_MINB 1
#endif
// STG 1: every warp copies its whole slice of weights and scales into shared memory (cp.async, 576 bytes per
// chunk and m16 tile) before pdl_wait, and the loop reads them from there. For a GEMV that follows
// latency-bound row kernels (the decode step's GDN out-projection, after the recurrence): its CTAs are
// placed while those run, and the DRAM streams the whole weight during them instead of a few chunks per
// warp. Only where one wave of CTAs holds the weight (linear.py, _stage_fits). The same arithmetic in the
// same order as STG 0: the same bits. (H200, session 24: the 27B decode step 17 us faster at 1k, 24 at 32k;
// TMA bulk copies instead of cp.async, or at most 3 / 5 chunks in flight per warp, were slower.)
#ifndef STG
#define STG 0
#endif
#if STG && LUMO_PROBE
#error "STG builds take no measurement probe"
#endif

__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {  // read once: keep it out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ld_stream2(const unsigned short* p) {
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4* dynamic_smem() {  // declared in a C++ function, as the epilogues declare it
  extern __shared__ uint4 smem[];
  return smem;
}

// Chunk r (counted from wp / sp, this lane's pointers into tile unit * 32 + lane) of a warp's MTW m16 tiles:
// weights and scale pairs, read once. No earlier kernel writes them (they may load before pdl_wait).
// kStaged (nvfp4_gemv_rd's STG): wp / sp point into the warp's shared-memory copy, chunks of MTW tiles.
template <bool kStaged = false>
__device__ __forceinline__ void load_tiles(uint4 (&w)[MTW], u32 (&s)[MTW], const uint4* wp,
                                           const unsigned short* sp, int r) {
#pragma unroll
  for (int p = 0; p < MTW; ++p) {
    if (kStaged) {
      w[p] = wp[((size_t)r * MTW + p) * 32];
      s[p] = sp[((size_t)r * MTW + p) * 32];
    } else {
      w[p] = ld_stream16(wp + ((size_t)r * MT + p) * 32);
      s[p] = ld_stream2(sp + ((size_t)r * MT + p) * 32);
    }
  }
}

// STG: this warp's nc chunks of MTW tiles from global (qw / qs at the slice's first chunk of the CTA's first
// tile, `unit`) into shared memory (wst / sst: [chunk][tile][32 lanes] of 16 and 2 bytes).
// A lane copies its own 16 bytes of weights; lanes 0..3 copy the tile-chunk's 64 bytes of scales.
__device__ __forceinline__ void stage_slice(uint4* wst, unsigned short* sst, const uint4* qw,
                                            const unsigned short* qs, size_t unit, int nc, int lane) {
  for (int r = 0; r < nc; ++r) {
#pragma unroll
    for (int p = 0; p < MTW; ++p) {
      const size_t src = (unit + (size_t)r * MT + p) * 32;
      cp_async16(wst + (r * MTW + p) * 32 + lane, qw + src + lane, 16, false);
      if (lane < 4) cp_async16(sst + (r * MTW + p) * 32 + 8 * lane, qs + src + 8 * lane, 16, false);
    }
    cp_async_commit();  // a group per chunk (the kernel waits for all of them after pdl_wait)
  }
}

// L2 prefetch before pdl_wait (nvfp4_gemv_rd / _sx): the row group's chunks r0 .. n - 1 of a split-K
// slice, all MT tiles (contiguous: n - r0 times MT * 512 bytes of weights and MT * 64 of scales), asked of
// L2 by one bulk prefetch each, from lane 0 of the warp that holds the row group's first tile (sm_90+;
// nothing below). While the previous kernel still runs (in the decode step mostly a row kernel, during
// which the DRAM would idle) the DRAM serves this kernel's first chunks, and the loads after pdl_wait
// hit L2. Weights only: nothing earlier in the stream writes them. No bit of the result depends on it.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void prefetch_chunks(const uint4* qw, const unsigned short* qs, size_t unit, int r0,
                                                int n) {  // unit: the row group's tile 0 at the slice's chunk 0
  if (n > r0) {
    prefetch_l2(qw + (unit + (size_t)r0 * MT) * 32, (n - r0) * MT * 512);
    prefetch_l2(qs + (unit + (size_t)r0 * MT) * 32, (n - r0) * MT * 64);
  }
}

#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_nvfp4_gemv_rd)
extern "C" __global__ void __launch_bounds__(KSW * 32, RD_MINB)
    nvfp4_gemv_rd(const uint4* __restrict__ qw, const unsigned short* __restrict__ qs,
                  const float* __restrict__ gs, const bf16* __restrict__ x, bf16* __restrict__ out, int M,
                  int N, int K, int C, int cps, int npf CONV_PARAMS) {
#if RDCL > 1 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90; linear.py never launches an RDCL build below
#endif
  TRACE_DECL(3);
  TRACE_AT(0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * MTW;
  const int c0 = (blockIdx.y * KSW + warp) * cps;  // slice blockIdx.y * KSW + warp (grid y: the cluster)
  const int nc = max(0, min(C, c0 + cps) - c0);
  // Tile (rg, c, p) of [RG][C][MT] holds 32 lanes x 16 bytes (qw) and 32 lanes x 2 bytes (qs).
  const size_t unit = ((size_t)(tile0 / MT) * C + c0) * MT + tile0 % MT;
#if STG
  // Dynamic smem after the epilogue's KSW * MTW * NT * 512 bytes: every warp's weights [warp][cps chunks]
  // [MTW tiles][32 lanes] x 16 bytes, then their scales in the same order x 2 bytes.
  uint4* const stage = dynamic_smem() + KSW * MTW * NT * 32;
  uint4* wst = stage + (size_t)warp * cps * MTW * 32;
  unsigned short* sst = reinterpret_cast<unsigned short*>(stage + (size_t)KSW * cps * MTW * 32) +
                        (size_t)warp * cps * MTW * 32;
  const uint4* wp = wst + lane;
  const unsigned short* sp = sst + lane;
  constexpr int kStride = MTW;  // m16 tiles from a lane's chunk r to r + 1
#else
  const uint4* wp = qw + unit * 32 + lane;
  const unsigned short* sp = qs + unit * 32 + lane;
  constexpr int kStride = MT;
#endif
  // B fragments: row 8j + g of x, columns 64c + 16t + 8h (h = 0, 1). Rows >= M read row 0 instead (an mma
  // column never mixes with another, and those columns are never stored); columns >= K are zero.
  const bf16* xp[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = 8 * j + g < M ? 8 * j + g : 0;
    xp[j] = x + (size_t)row * K + (size_t)c0 * 64 + 16 * t;
  }
  // Chunks of this slice whose 64 columns all lie below K (K % 16 == 0: only the weight's last chunk can
  // straddle K): their activation loads need no bounds check.
  const int nfull = (K % 64 != 0 && c0 + nc == C) ? nc - 1 : nc;

  uint4 wr[PF][MTW];
  u32 sr[PF][MTW];
  uint4 xr[PF][NT][2];
  // The loads address chunk i0 + r: the pointers move by PF chunks per loop trip and r is a compile-time
  // offset after unrolling (no per-chunk address arithmetic).
  auto load_w = [&](int slot, int r) { load_tiles<(STG != 0)>(wr[slot], sr[slot], wp, sp, r); };
  auto load_x = [&](int slot, int r, bool kin) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        xr[slot][j][h] = kin ? *reinterpret_cast<const uint4*>(xp[j] + (PROBE_X0 ? 0 : r * 64) + 8 * h)
                             : make_uint4(0u, 0u, 0u, 0u);
  };
  auto advance = [&](int chunks) {
    if (!PROBE_L2W) {  // the L2-resident probe keeps reading its first two chunks
      wp += (size_t)chunks * kStride * 32;
      sp += (size_t)chunks * kStride * 32;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) xp[j] += PROBE_X0 ? 0 : chunks * 64;
  };

  float acc[MTW][NT][4] = {};

#if STG
  stage_slice(wst, sst, qw, qs, unit, nc, lane);  // the whole slice, before the wait (PDL)
#else
#pragma unroll
  for (int i = 0; i < PF - 1; ++i)  // prologue weights before the wait for the previous kernel (PDL)
    if (i < nc) load_w(i, PROBE_CHUNK(i));
  if (tile0 % MT == 0 && lane == 0) prefetch_chunks(qw, qs, unit, PF - 1, min(nc, npf));
#endif
#if CONV
  {
    const int slice = (RDCL > 1 ? (int)cluster_rank() * KSW : 0) + warp;  // stores tile slice / NT (M == 1)
    if (slice < MTW * NT)
      conv_prefetch(ConvEpi{conv_w, conv_state, conv_y, conv_c}, (tile0 + slice / NT) * 16, lane);
  }
#endif
  pdl_wait();
  TRACE_AT(1);
#pragma unroll
  for (int i = 0; i < PF - 1; ++i)
    if (i < nc) load_x(i, i, (c0 + i) * 64 + 16 * t < K);
#if STG
  cp_async_wait<0>();
  __syncwarp();  // lanes 0..3 copied the warp's scales
#pragma unroll
  for (int i = 0; i < PF - 1; ++i)
    if (i < nc) load_w(i, i);
#endif
  // Chunk i0 + u (slot u): first refill the slot chunk i0 + u - 1 used with chunk i0 + u + PF - 1, if any.
  auto step = [&](int u, int i0, bool fast) {  // fast: the refill exists and lies below nfull (no checks)
    const int r = u + PF - 1;
    if (fast || i0 + r < nc) {
      load_w(r % PF, PROBE_L2W ? (i0 + r) & 1 : r);
      load_x(r % PF, r, fast || (c0 + i0 + r) * 64 + 16 * t < K);
    }
#pragma unroll
    for (int p = 0; p < MTW; ++p) fp4_tile_mma(acc[p], wr[u][p], sr[u][p], xr[u]);
  };
  int i0 = 0;
  for (; i0 + 2 * PF - 2 < nfull; i0 += PF, advance(PF))  // steady state: every refill is fast
#pragma unroll
    for (int u = 0; u < PF; ++u) step(u, i0, true);
  for (; i0 + PF <= nc; i0 += PF, advance(PF))
#pragma unroll
    for (int u = 0; u < PF; ++u) step(u, i0, false);
#pragma unroll
  for (int u = 0; u < PF - 1; ++u)
    if (i0 + u < nc) step(u, i0, false);
  TRACE_AT(2);
  pdl_trigger();
  slices_reduce_store(acc, gs, out, M, N, tile0, warp, lane CONV_EPI);
  TRACE_STORE(3, TRACE_KIND_GEMV, qw);
}
#endif

// Slice activations in shared memory (nvfp4_gemv_sx, M <= 8 * NT; the verify's M = 32 GEMVs). CTA (b, s)
// = SXW warps of MTW m16 tiles each (SXW * MTW / MT row groups) and split-K slice s. The register-direct
// kernel above reads each warp's B fragments from L1 / L2 (at NT = 4 four bytes of activations per weight
// byte, and a 64-register activation ring); here the slice's activations (cps chunks x NT n8 tiles, 1 KB
// each) are copied into shared memory once per CTA, in XWIN windows (cp.async, one barrier per window),
// and every warp reads its fragments with LDS right before use, while it streams its weights straight into
// registers PF chunks ahead as nvfp4_gemv_rd does. A warp's K order is the same (chunks in order, k-steps in
// order), and the S slices of a tile are summed in slice order by cluster_reduce_store (clusters of the S
// CTAs, sm_90+) or through the partials and splitk_reduce: bitwise nvfp4_gemv + splitk_reduce.
// grid (ceil(RG * MT / (SXW * MTW)), S), block 32 * SXW; dynamic smem max(cps * NT * 1024, the
// cluster epilogue's SXW * MTW * NT * 512) bytes.
#ifndef SXW
#define SXW 8  // nvfp4_gemv_sx: warps per CTA (SXW * MTW a multiple of MT)
#endif
#define XWIN 4  // nvfp4_gemv_sx: activation windows (cp.async groups) per slice

__device__ __forceinline__ void cp_async_wait_upto(int n) {  // groups beyond the newest n have landed
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

template <bool kCluster>
__device__ __forceinline__ void nvfp4_gemv_sx_body(const uint4* __restrict__ qw,
                                                   const unsigned short* __restrict__ qs,
                                                   const float* __restrict__ gs, const bf16* __restrict__ x,
                                                   bf16* __restrict__ out, float* __restrict__ partial, int M,
                                                   int N, int K, int RG, int C, int cps, int npf) {
  static_assert((SXW * MTW) % MT == 0 && MT % MTW == 0, "a CTA holds whole row groups");
  extern __shared__ uint4 smem[];
  const char* xs = reinterpret_cast<const char*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile0 = (blockIdx.x * SXW + warp) * MTW;
  const bool active = tile0 < RG * MT;  // the last CTA may hold idle warps (they still copy and sync)
  const int c0 = blockIdx.y * cps;
  const int nc = max(0, min(C, c0 + cps) - c0);
  const size_t unit = ((size_t)(tile0 / MT) * C + c0) * MT + tile0 % MT;
  const uint4* wp = qw + unit * 32 + lane;
  const unsigned short* sp = qs + unit * 32 + lane;

  uint4 wr[PF][MTW];
  u32 sr[PF][MTW];
  auto load_w = [&](int slot, int r) { load_tiles(wr[slot], sr[slot], wp, sp, r); };  // chunk i0 + r

#pragma unroll
  for (int i = 0; i < PF - 1; ++i)  // prologue weights before the wait for the previous kernel (PDL)
    if (active && i < nc) load_w(i, PROBE_CHUNK(i));
  if (active && tile0 % MT == 0 && lane == 0) prefetch_chunks(qw, qs, unit, PF - 1, min(nc, npf));
  pdl_wait();

  // The slice's activations: piece (i, j, h, l) (16 bytes: row 8j + g, columns 64(c0 + i) + 16t + 8h of
  // lane l = 4g + t) at byte ((i * NT + j) * 2 + h) * 512 + 16 l, zero for rows >= M and columns >= K.
  // Thread q copies the pieces in global order (8 per row: 128 contiguous bytes), window by window.
  const int wc = (nc + XWIN - 1) / XWIN;  // chunks per window
#pragma unroll 1
  for (int w = 0; w < XWIN; ++w) {
    const int q1 = min(nc, (w + 1) * wc) * NT * 64;
    for (int q = w * wc * NT * 64 + threadIdx.x; q < q1; q += SXW * 32) {
      const int seg = q & 7, g = (q >> 3) & 7, j = (q >> 6) % NT, i = (q >> 6) / NT;
      const int row = 8 * j + g, col = (c0 + i) * 64 + 8 * seg;
      const bool ok = row < M && col < K;
      char* dst = reinterpret_cast<char*>(smem) + ((i * NT + j) * 2 + (seg & 1)) * 512;
      dst += (4 * g + (seg >> 1)) * 16;
      cp_async16(dst, ok ? x + (size_t)row * K + col : x, ok ? 16 : 0, true);
    }
    cp_async_commit();
  }
  int ready = 0, win = 0;  // chunks [0, ready) are in shared memory for every warp
  auto need = [&](int upto) {
    while (ready < upto) {
      cp_async_wait_upto(XWIN - 1 - win);
      __syncthreads();
      ++win;
      ready = min(nc, win * wc);
    }
  };

  float acc[MTW][NT][4] = {};
  auto step = [&](int u, int i0, bool refill) {  // chunk i0 + u in slot u; first refill the previous slot
    const int r = u + PF - 1;
    if (refill) load_w(r % PF, PROBE_L2W ? (i0 + r) & 1 : r);
    const char* xc = xs + (size_t)(i0 + u) * NT * 1024 + lane * 16;
    uint4 xv[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) xv[j][h] = *reinterpret_cast<const uint4*>(xc + (j * 2 + h) * 512);
#pragma unroll
    for (int p = 0; p < MTW; ++p) fp4_tile_mma(acc[p], wr[u][p], sr[u][p], xv);
  };
  auto advance = [&]() {
    if (!PROBE_L2W) {
      wp += (size_t)PF * MT * 32;
      sp += (size_t)PF * MT * 32;
    }
  };
  if (active) {
    int i0 = 0;
    for (; i0 + 2 * PF - 2 < nc; i0 += PF, advance()) {  // every refill of the trip exists
      need(i0 + PF);
#pragma unroll
      for (int u = 0; u < PF; ++u) step(u, i0, true);
    }
    for (; i0 + PF <= nc; i0 += PF, advance()) {
      need(i0 + PF);
#pragma unroll
      for (int u = 0; u < PF; ++u) step(u, i0, i0 + u + PF - 1 < nc);
    }
    need(nc);
#pragma unroll
    for (int u = 0; u < PF - 1; ++u)
      if (i0 + u < nc) step(u, i0, false);
  } else {
    need(nc);  // the same barriers as the active warps
  }
  pdl_trigger();
  if (kCluster) {
    cluster_reduce_store<SXW * MTW / MT, MTW>(acc, gs, DQ_UNSCALE, blockIdx.x * (SXW * MTW / MT), out, M, N,
                                             lane, warp);
  } else if (active) {
    store_tile<MTW>(acc, gs, out, partial, M, N, tile0 * 16, lane, DQ_UNSCALE);
  }
}

#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_nvfp4_gemv_sx)
extern "C" __global__ void __launch_bounds__(SXW * 32)
    nvfp4_gemv_sx(const uint4* __restrict__ qw, const unsigned short* __restrict__ qs,
                  const float* __restrict__ gs, const bf16* __restrict__ x, bf16* __restrict__ out,
                  float* __restrict__ partial, int M, int N, int K, int RG, int C, int cps, int npf) {
  nvfp4_gemv_sx_body<false>(qw, qs, gs, x, out, partial, M, N, K, RG, C, cps, npf);
}
#endif

#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_nvfp4_gemv_sx_cl)
extern "C" __global__ void __launch_bounds__(SXW * 32)
    nvfp4_gemv_sx_cl(const uint4* __restrict__ qw, const unsigned short* __restrict__ qs,
                     const float* __restrict__ gs, const bf16* __restrict__ x, bf16* __restrict__ out, int M,
                     int N, int K, int RG, int C, int cps, int npf) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  nvfp4_gemv_sx_body<true>(qw, qs, gs, x, out, nullptr, M, N, K, RG, C, cps, npf);
#else
  __trap();  // clusters need sm_90; linear.py never launches this below
#endif
}
#endif

// Plain bf16 weights w [N, K] (row major, K % 16 == 0) take the same tiling: a lane's 16 columns of rows g
// and g+8 are 32 contiguous bytes each, so no repacking is needed. The K order (part of the bits): split-K
// slice s covers chunks [s * cps, min(C, (s + 1) * cps)), its chunk i goes to accumulator i % KW, the KW
// accumulators are summed in order (a = acc_0, a += acc_w), then the slices in slice order (splitk_reduce).
//
// One chunk of one m16 tile of bf16 weights: wv[r][h] = rows g + 8r, columns 16t + 8h of the chunk (a lane's
// A fragments for the four k-steps), xv[j][h] the n8 tile j's B fragments: row 8j + g, the same columns.
__device__ __forceinline__ void bf16_tile_mma(float (*acc)[4], const uint4 (&wv)[2][2],
                                              const uint4 (*xv)[2]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const u32* wg = reinterpret_cast<const u32*>(&wv[0][s >> 1]);
    const u32* wg8 = reinterpret_cast<const u32*>(&wv[1][s >> 1]);
    const int q = (s & 1) * 2;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const u32* xw = reinterpret_cast<const u32*>(&xv[j][s >> 1]);
      mma_bf16(acc[j], wg[q], wg8[q], wg[q + 1], wg8[q + 1], xw[q], xw[q + 1]);
    }
  }
}

// A lane's A fragments of one m16 tile of bf16 weights (rows row, row + 8, columns col .. col + 15; the layout
// bf16_tile_mma reads) and its B fragments of the NT n8 tiles of x (row 8j + g, the same columns); rows past
// N or M and columns past K read as zero. Weights stream past L1 (no earlier kernel writes them).
__device__ __forceinline__ void bf16_load_w(uint4 (&wv)[2][2], const bf16* __restrict__ w, int N, int K, int row,
                                            int col) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok = row + 8 * r < N && col < K;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wv[r][h] = ok ? ld_stream16(reinterpret_cast<const uint4*>(w + (size_t)(row + 8 * r) * K + col + 8 * h))
                    : make_uint4(0u, 0u, 0u, 0u);
  }
}
__device__ __forceinline__ void bf16_load_x(uint4 (&xv)[NT][2], const bf16* __restrict__ x, int M, int K, int g,
                                            int col) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const bool ok = 8 * j + g < M && col < K;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      xv[j][h] = ok ? *reinterpret_cast<const uint4*>(x + (size_t)(8 * j + g) * K + col + 8 * h)
                    : make_uint4(0u, 0u, 0u, 0u);
  }
}

// bf16_gemv: grid (ceil(N / (16 * MT)), S), block 32 * KW. CTA (b, s) covers the MT m16 tiles from row
// 16 * MT * b and split-K slice s; warp w takes the slice's chunks w, w + KW, ... (accumulator w of the K
// order), each loaded straight into registers, weights RPF and activations XPF chunks ahead (the loop is
// unrolled RPF times: ring slots are compile-time indices); the warps are summed in warp order through
// (KW - 1) * MT * NT * 512 bytes of shared memory, and with S > 1 the slices go through fp32 partials
// [S, M, N] and splitk_reduce. Small CTAs without a ring let many share an SM and keep the DRAM busy
// (session 17, H200: 36-48% of copy bandwidth for the ring kernel it replaced, one ~150 KB CTA per SM;
// docs/kernels.md). The slices' cluster epilogue was slower for these CTAs (and is not built for them).
#ifndef RPF
#define RPF 2  // bf16_gemv: weight chunks in flight per warp
#endif
#ifndef XPF
#define XPF RPF  // bf16_gemv: activation chunks in flight per warp (a divisor of RPF; 1: loaded at use)
#endif
#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_bf16_gemv)
extern "C" __global__ void __launch_bounds__(KW * 32)
    bf16_gemv(const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ out,
              float* __restrict__ partial, int M, int N, int K, int C, int cps) {
  static_assert(RPF % XPF == 0, "ring slots are compile-time indices within each RPF-chunk trip");
  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * MT * 16;
  const int c0 = blockIdx.y * cps + warp;
  const int c1 = min(C, (int)(blockIdx.y + 1) * cps);
  const int nc = c0 < c1 ? (c1 - c0 + KW - 1) / KW : 0;  // this warp's chunks: c0 + i * KW, i < nc

  uint4 wr[RPF][MT][2][2];  // [slot][tile][row g, g + 8][columns 16t + 8h]
  uint4 xr[XPF][NT][2];
  auto load_w = [&](int slot, int i) {
#pragma unroll
    for (int p = 0; p < MT; ++p) bf16_load_w(wr[slot][p], w, N, K, row0 + 16 * p + g, (c0 + i * KW) * 64 + 16 * t);
  };
  auto load_x = [&](int slot, int i) { bf16_load_x(xr[slot], x, M, K, g, (c0 + i * KW) * 64 + 16 * t); };

  float acc[MT][NT][4] = {};
#pragma unroll
  for (int i = 0; i < RPF - 1; ++i)  // prologue weights before the wait for the previous kernel (PDL)
    if (i < nc) load_w(i, i);
  pdl_wait();
#pragma unroll
  for (int i = 0; i < XPF - 1; ++i)
    if (i < nc) load_x(i, i);
  for (int i0 = 0; i0 < nc; i0 += RPF) {
#pragma unroll
    for (int u = 0; u < RPF; ++u) {
      const int i = i0 + u;
      if (i < nc) {
        // Refill the slots chunk i - 1 used (i0 % RPF == 0, so slots are u's residues).
        if (i + RPF - 1 < nc) load_w((u + RPF - 1) % RPF, i + RPF - 1);
        if (i + XPF - 1 < nc) load_x((u + XPF - 1) % XPF, i + XPF - 1);
#pragma unroll
        for (int p = 0; p < MT; ++p) bf16_tile_mma(acc[p], wr[u][p], xr[u % XPF]);
      }
    }
  }
  pdl_trigger();
  reduce_warps<KW, MT>(acc, reinterpret_cast<char*>(smem), warp, lane);
  if (warp == 0) store_tile<MT>(acc, nullptr, out, partial, M, N, row0, lane);
}
#endif

// Small-N bf16 weights, register direct (bf16_gemv_rd): grid (ceil(N / 16), S), block 32. One warp per
// m16 tile and split-K slice, holding all KW accumulators, its operands loaded straight into registers BPF
// chunks ahead, no shared memory: 32-thread CTAs that fit beside a concurrent GEMV's (the GDN b/a
// projection runs on a side stream next to q/k/v/z). The K order is bf16_gemv's: the slice's chunk i goes
// to accumulator i % KW, the KW accumulators are summed in that order (reduce_warps' a = acc_0, a +=
// acc_w), then the tile is stored (S = 1) or written as slice partials for splitk_reduce: bf16_gemv's bits.
#ifndef BPF
#define BPF 4  // bf16_gemv_rd: chunks in flight per warp (a divisor of KW)
#endif
#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_bf16_gemv_rd)
extern "C" __global__ void __launch_bounds__(32)
    bf16_gemv_rd(const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ out,
                 float* __restrict__ partial, int M, int N, int K, int C, int cps) {
  static_assert(KW % BPF == 0, "a ring slot is a compile-time index within each KW-chunk trip");
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int c0 = blockIdx.y * cps;
  const int nc = max(0, min(C, c0 + cps) - c0);

  uint4 wr[BPF][2][2];  // [slot][row g, g + 8][columns 16t + 8h]
  uint4 xr[BPF][NT][2];
  auto load_w = [&](int slot, int i) { bf16_load_w(wr[slot], w, N, K, row0 + g, (c0 + i) * 64 + 16 * t); };
  auto load_x = [&](int slot, int i) { bf16_load_x(xr[slot], x, M, K, g, (c0 + i) * 64 + 16 * t); };

  float acc[KW][NT][4] = {};
#pragma unroll
  for (int i = 0; i < BPF - 1; ++i)  // prologue weights before the wait for the previous kernel (PDL)
    if (i < nc) load_w(i, i);
  pdl_wait();
#pragma unroll
  for (int i = 0; i < BPF - 1; ++i)
    if (i < nc) load_x(i, i);
  for (int i0 = 0; i0 < nc; i0 += KW) {
#pragma unroll
    for (int u = 0; u < KW; ++u) {
      const int i = i0 + u;
      if (i < nc) {
        const int slot = u % BPF, refill = (u + BPF - 1) % BPF;  // i0 % BPF == 0
        if (i + BPF - 1 < nc) {
          load_w(refill, i + BPF - 1);
          load_x(refill, i + BPF - 1);
        }
        bf16_tile_mma(acc[u], wr[slot], xr[slot]);
      }
    }
  }
  pdl_trigger();
  float sum[1][NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float a = acc[0][j][e];
#pragma unroll
      for (int v = 1; v < KW; ++v) a += acc[v][j][e];
      sum[0][j][e] = a;
    }
  store_tile<1>(sum, nullptr, out, partial, M, N, row0, lane);
}
#endif

// out[m, n] = bf16(gs[n] * sum_s partial[s, m, n]), slices summed in slice order (batch invariant).
// PDL-launched after the GEMV: it waits for the partials, nothing else to prefetch.
#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_splitk_reduce)
extern "C" __global__ void splitk_reduce(const float* __restrict__ partial, const float* __restrict__ gs,
                                         bf16* __restrict__ out, int M, int N, int S) {
  pdl_wait();
  pdl_trigger();
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= M * N) return;
  float a = partial[idx];
  for (int s = 1; s < S; ++s) a += partial[(size_t)s * M * N + idx];
  out[idx] = __float2bfloat16_rn(a * (gs ? gs[idx % N] : 1.0f));
}
#endif

// Prefill: rows [rg0 * 16 * MT, ...) of the packed weight -> bf16 out [rows, K] (gs applied in fp32, one
// rounding). One thread per (row group, chunk, m16 tile, lane): 16 packed bytes -> 2 rows x 16 columns.
#if !defined(LUMO_ONLY) || defined(LUMO_ONLY_nvfp4_dequant)
extern "C" __global__ void nvfp4_dequant(const uint4* __restrict__ qw, const unsigned short* __restrict__ qs,
                                         const float* __restrict__ gs, bf16* __restrict__ out, int rg0,
                                         int nrg, int N, int K, int C) {
  const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long)nrg * C * MT * 32) return;
  const int lane = idx & 31;
  const int p = (idx >> 5) % MT;
  const int c = (int)((idx / (32 * MT)) % C);
  const int rg = rg0 + (int)(idx / ((long)32 * MT * C));
  const int g = lane >> 2, t = lane & 3;
  const long src = ((long)rg * C + c) * MT + p;
  const uint4 wv = qw[src * 32 + lane];
  const u32 sv = qs[src * 32 + lane];
  const u32 sg = scale2(sv, 0x4040), sg8 = scale2(sv, 0x4141);
  const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
  u32 rowg[8], rowg8[8];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    u32 A, B, Cr, D;
    dequant8(words[s], A, B, Cr, D);
    rowg[2 * s] = bmul2(A, sg);
    rowg[2 * s + 1] = bmul2(Cr, sg);
    rowg8[2 * s] = bmul2(B, sg8);
    rowg8[2 * s + 1] = bmul2(D, sg8);
  }
  const int col = c * 64 + 16 * t;
  if (col >= K) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = rg * MT * 16 + p * 16 + g + 8 * h;
    if (n >= N) continue;
    const float scale = gs[n] * DQ_UNSCALE;  // exact (power of two)
    const u32* v = h ? rowg8 : rowg;
    u32 o[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[q]));
      __nv_bfloat162 r = __floats2bfloat162_rn(f.x * scale, f.y * scale);
      o[q] = *reinterpret_cast<u32*>(&r);
    }
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)(n - rg0 * MT * 16) * K + col);
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}
#endif
