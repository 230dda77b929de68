// One row of rmsnorm1p with a fused residual add, the arithmetic of norms.cu's rmsnorm1p_residual as a CTA
// of kVnt threads performs it, run by a CTA of kRw warps (any number): real warp r plays the
// virtual warps r, r + kRw, r + 2 kRw, ... with the same lanes. Every sum is therefore formed in the same
// order whatever the real CTA: per virtual thread the squares of its chunks in order (fmaf chain), the xor
// butterfly of its virtual warp, then the virtual warps' sums in warp order. Chunk i of virtual thread
// t = 32 vw + lane is the 8 values from 8 (t + i kVnt).
//   h = bf16(h + delta)   (when delta != null; stored in place: the residual stream)
//   y = bf16((h * rsqrt(sum(h^2) / kHid + eps)) * (1 + w))
// Used by rmsnorm1p_residual (kRw = kVnt / 32: one virtual warp per warp) and by nvfp4_gemv_rd's residual
// tail (linear.cu, RNORM: the grid's last CTA normalises the row the grid has just written).
#pragma once

#include <cuda_bf16.h>

#include "act.cuh"
#include "vec.cuh"

// 8 floats -> 8 bf16 (16 bytes), round to nearest even (st_bf16's conversion).
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  uint4 u;
  __nv_bfloat162* b = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) b[j] = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
  return u;
}

// 8 bf16 (16 bytes) -> 8 floats, exactly.
__device__ __forceinline__ void unpack8(const uint4& u, float (&x)[8]) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(b[j]);
    x[2 * j] = f.x;
    x[2 * j + 1] = f.y;
  }
}

template <int kHid, int kVnt, int kRw>
struct RmsRow {
  static_assert(kHid % 8 == 0 && kVnt % 32 == 0, "kHid: 16-byte vectors; kVnt: whole warps");
  static constexpr int CHUNKS = kHid / 8;
  static constexpr int CPT = (CHUNKS + kVnt - 1) / kVnt;  // chunks per virtual thread
  static constexpr int VW = kVnt / 32;                  // virtual warps
  static constexpr int VPR = (VW + kRw - 1) / kRw;       // virtual warps per real warp
  const int warp, lane;

  __device__ RmsRow(int warp_, int lane_) : warp(warp_), lane(lane_) {}

  // Chunk i of this lane in its p-th virtual warp, or -1 (past the row, or no such virtual warp).
  __device__ __forceinline__ int chunk(int p, int i) const {
    const int vw = warp + p * kRw;
    const int c = vw * 32 + lane + i * kVnt;
    return vw < VW && c < CHUNKS ? c : -1;
  }

  // The norm weight (no kernel writes it: may load before pdl_wait) and an L2 request for h's lines.
  __device__ __forceinline__ void load_w(const __nv_bfloat16* __restrict__ w, float (&wv)[VPR][CPT][8],
                                         const __nv_bfloat16* h_prefetch = nullptr) const {
#pragma unroll
    for (int p = 0; p < VPR; ++p)
#pragma unroll
      for (int i = 0; i < CPT; ++i)
        if (const int c = chunk(p, i); c >= 0) {
          ld_bf16<8>(w + 8 * c, wv[p][i]);
          if (h_prefetch != nullptr) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(h_prefetch + 8 * c));
        }
  }

  // h (+ delta, stored back) into v (8 bf16 per chunk, packed: exact, and half the registers), and each
  // virtual warp's sum of squares into partial[vw] (shared memory, VW floats). Every load is issued
  // before any arithmetic (one round trip for all of a lane's virtual threads). kCG: h and delta read
  // through L2 (values other CTAs of this grid wrote).
  template <bool kCG>
  __device__ __forceinline__ void squares(__nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ delta,
                                          uint4 (&v)[VPR][CPT], float* partial) const {
    uint4 dl[VPR][CPT];
#pragma unroll
    for (int p = 0; p < VPR; ++p)
#pragma unroll
      for (int i = 0; i < CPT; ++i)
        if (const int c = chunk(p, i); c >= 0) {
          const uint4* hp = reinterpret_cast<const uint4*>(h + 8 * c);
          v[p][i] = kCG ? __ldcg(hp) : *hp;
          if (delta != nullptr) {
            const uint4* dp = reinterpret_cast<const uint4*>(delta + 8 * c);
            dl[p][i] = kCG ? __ldcg(dp) : *dp;
          }
        }
#pragma unroll
    for (int p = 0; p < VPR; ++p) {
      if (warp + p * kRw >= VW) break;  // warp-uniform
      float ss = 0.0f;
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
        const int c = chunk(p, i);
        if (c < 0) continue;
        float x[8];
        unpack8(v[p][i], x);
        if (delta != nullptr) {
          float d[8];
          unpack8(dl[p][i], d);
#pragma unroll
          for (int j = 0; j < 8; ++j) x[j] = round_bf16(__fadd_rn(x[j], d[j]));  // torch bf16 add
          v[p][i] = pack8(x);  // exact: x holds bf16 values
          *reinterpret_cast<uint4*>(h + 8 * c) = v[p][i];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) ss = fmaf(x[j], x[j], ss);
      }
      ss = warp_sum(ss);
      if (lane == 0) partial[warp + p * kRw] = ss;
    }
  }

  // After a barrier that makes partial complete: y from v and the weight (wv, or loaded here from w).
  __device__ __forceinline__ float scale(const float* partial, float eps) const {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < VW; ++k) total = __fadd_rn(total, partial[k]);  // warp order: fixed
    return rsqrtf(__fadd_rn(__fdiv_rn(total, (float)kHid), eps));
  }
  __device__ __forceinline__ void store_chunk(__nv_bfloat16* __restrict__ y, int c, const uint4& v,
                                              const float (&wv)[8], float r) const {
    float x[8], o[8];
    unpack8(v, x);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = __fmul_rn(__fmul_rn(x[j], r), __fadd_rn(1.0f, wv[j]));
    st_bf16<8>(y + 8 * c, o);
  }
  __device__ __forceinline__ void store(__nv_bfloat16* __restrict__ y, const uint4 (&v)[VPR][CPT],
                                        const float (&wv)[VPR][CPT][8], const float* partial, float eps) const {
    const float r = scale(partial, eps);
#pragma unroll
    for (int p = 0; p < VPR; ++p)
#pragma unroll
      for (int i = 0; i < CPT; ++i)
        if (const int c = chunk(p, i); c >= 0) store_chunk(y, c, v[p][i], wv[p][i], r);
  }
  __device__ __forceinline__ void store(__nv_bfloat16* __restrict__ y, const uint4 (&v)[VPR][CPT],
                                        const __nv_bfloat16* __restrict__ w, const float* partial, float eps) const {
    const float r = scale(partial, eps);
#pragma unroll
    for (int p = 0; p < VPR; ++p)
#pragma unroll
      for (int i = 0; i < CPT; ++i)
        if (const int c = chunk(p, i); c >= 0) {
          float wv[8];
          ld_bf16<8>(w + 8 * c, wv);
          store_chunk(y, c, v[p][i], wv, r);
        }
  }
};
