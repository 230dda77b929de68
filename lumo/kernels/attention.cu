// Decode / tree-verify attention: T query rows (1 = plain decode, <= 32 tree rows) against one KV cache slot.
//
// Keys of row t, in logical position order: the committed prefix [0, len) (cache slot p = position p), then
// the tree slots whose bit is set in mask[t], in slot order (parents precede children, so slot order is depth
// order): the k-th set bit j sits at logical position len + k. Row t sees n_t = len + popcount(mask[t]) keys.
//
// Split-K over FIXED chunks of logical positions: chunk c = positions [c*CHUNK, (c+1)*CHUNK), whatever len
// and T are. Inside a chunk, warp `sub` owns positions [c*CHUNK + sub*SUB, +SUB) and walks them in order
// (scores, then exp/sum/PV in position order); the NSUB sub-partials are combined in sub order, the chunks
// by attn_decode_merge in chunk order. Everything a row computes is a function of (its q, its n_t keys in
// position order) only: T, the row's index and the other rows never enter its arithmetic (batch invariant),
// and a tree row equals the plain decode of the same token after its ancestors were committed.
//
// Work split: CTA = (chunk, kv head); RW row groups of NSUB warps; row group r handles rows r, r+RW, ...
// One warp computes all G query heads of the group for its row and sub-chunk: a K/V row is loaded once
// (lane = DPL contiguous dims, 16 B for d=256) and used for G dot products (warp butterfly reductions).
//
// lumo:test-defines D=256 G=6
// lumo:test-defines D=64 G=2

#include <cuda_bf16.h>

#ifndef D
#define D 256  // head dim
#endif
#ifndef G
#define G 6  // query heads per kv head (nh / nkv)
#endif
#define CHUNK 256  // positions per split-K partial (part of the arithmetic: fixed)
#define SUB 64     // positions per warp inside a chunk (part of the arithmetic: fixed)
#define NSUB (CHUNK / SUB)
#define RW 2  // rows processed in parallel per CTA (launch choice only)
#define DPL (D / 32)
#define THREADS (32 * NSUB * RW)

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;
#define INFINITY __int_as_float(0x7f800000)

// DPL contiguous bf16 of one lane in one vector load (16 B for d = 256, 4 B for d = 64).
#if DPL == 8
typedef uint4 Raw;
#elif DPL == 4
typedef uint2 Raw;
#elif DPL == 2
typedef unsigned int Raw;
#endif

__device__ __forceinline__ void load_vec(const bf16* p, float* f) {
  union {
    Raw raw;
    __nv_bfloat162 h[DPL / 2];
  } v;
  v.raw = __ldg(reinterpret_cast<const Raw*>(p));
#pragma unroll
  for (int j = 0; j < DPL / 2; ++j) {
    float2 x = __bfloat1622float2(v.h[j]);
    f[2 * j] = x.x;
    f[2 * j + 1] = x.y;
  }
}

__device__ __forceinline__ float warp_sum(float x) {
  // xor butterfly: every lane ends with the same bits (a + b == b + a).
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int kth_set_bit(u64 m, int k) {
  for (int i = 0; i < k; ++i) m &= m - 1;
  return __ffsll((long long)m) - 1;
}

// Shared memory: scores [NSUB*RW warps][G][SUB], then per row group sub-partials acc [NSUB][G][D] and
// (m, l) [NSUB][G][2].
extern "C" __global__ void __launch_bounds__(THREADS)
    attn_decode_chunk(const bf16* __restrict__ q,          // [T, nkv*G, D]
                      const bf16* __restrict__ kc,         // [max_len, nkv, D]
                      const bf16* __restrict__ vc,         // [max_len, nkv, D]
                      const int* __restrict__ length,      // [1] committed positions len
                      const long long* __restrict__ mask,  // [T] tree-slot bitmask per row
                      float* __restrict__ part_acc,        // [T, nkv*G, nch, D]
                      float* __restrict__ part_ml,         // [T, nkv*G, nch, 2]
                      int T, int nkv, int max_len, int nch) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = warp / NSUB, sub = warp % NSUB;
  const int c = blockIdx.x, h = blockIdx.y, nh = nkv * G;
  const int len = *length;
  if (c * CHUNK >= len + 64) return;  // past every row's keys (popcount <= 64): uniform per CTA

  float* sc = smem + warp * (G * SUB);
  float* pacc = smem + NSUB * RW * G * SUB + rg * (NSUB * G * (D + 2));
  float* pml = pacc + NSUB * G * D;
  const float scale = 1.0f / sqrtf((float)D);  // exact for D = 64, 256
  const size_t kv_row = (size_t)nkv * D;

  for (int t0 = 0; t0 < T; t0 += RW) {
    const int t = t0 + rg;
    const bool active = t < T;
    const u64 mk = active ? (u64)mask[t] : 0ull;
    const int n = len + __popcll(mk);  // keys of row t
    const int p_begin = c * CHUNK + sub * SUB;
    const int p_end = active ? min(p_begin + SUB, n) : p_begin;

    float m[G], l[G], acc[G][DPL], qv[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.0f;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[g][j] = 0.0f;
      if (p_end > p_begin) load_vec(q + ((size_t)t * nh + h * G + g) * D + lane * DPL, qv[g]);
    }
    // Pass A: scores in position order, max.
    for (int p = p_begin; p < p_end; ++p) {
      const int slot = p < len ? p : len + kth_set_bit(mk, p - len);
      float kv[DPL];
      if (slot < max_len) {
        load_vec(kc + (size_t)slot * kv_row + h * D + lane * DPL, kv);
      } else {
#pragma unroll
        for (int j = 0; j < DPL; ++j) kv[j] = 0.0f;  // out-of-range slot (caller error): no OOB read
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < DPL; ++j) s = fmaf(qv[g][j], kv[j], s);
        s = warp_sum(s) * scale;
        m[g] = fmaxf(m[g], s);
        if (lane == 0) sc[g * SUB + (p - p_begin)] = s;
      }
    }
    __syncwarp();
    // Pass B: exp, sum and P.V in position order.
    for (int p = p_begin; p < p_end; ++p) {
      const int slot = p < len ? p : len + kth_set_bit(mk, p - len);
      float vv[DPL];
      if (slot < max_len) {
        load_vec(vc + (size_t)slot * kv_row + h * D + lane * DPL, vv);
      } else {
#pragma unroll
        for (int j = 0; j < DPL; ++j) vv[j] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float w = expf(sc[g * SUB + (p - p_begin)] - m[g]);
        l[g] += w;
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[g][j] = fmaf(w, vv[j], acc[g][j]);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int j = 0; j < DPL; ++j) pacc[(sub * G + g) * D + lane * DPL + j] = acc[g][j];
      if (lane == 0) {
        pml[(sub * G + g) * 2] = m[g];
        pml[(sub * G + g) * 2 + 1] = l[g];
      }
    }
    __syncthreads();
    // Combine the NSUB sub-partials in sub order; the row group's 32*NSUB threads split the G*D outputs.
    if (active && c * CHUNK < n) {
      for (int i = threadIdx.x % (32 * NSUB); i < G * D; i += 32 * NSUB) {
        const int g = i / D, k = i % D;
        float M = -INFINITY;
#pragma unroll
        for (int s = 0; s < NSUB; ++s) M = fmaxf(M, pml[(s * G + g) * 2]);
        float L = 0.0f, A = 0.0f;
#pragma unroll
        for (int s = 0; s < NSUB; ++s) {
          const float ms = pml[(s * G + g) * 2];
          const float f = ms == -INFINITY ? 0.0f : expf(ms - M);  // empty sub-chunk contributes nothing
          L = fmaf(pml[(s * G + g) * 2 + 1], f, L);
          A = fmaf(pacc[(s * G + g) * D + k], f, A);
        }
        const size_t row = ((size_t)t * nh + h * G + g) * nch + c;
        part_acc[row * D + k] = A;
        if (k == 0) {
          part_ml[row * 2] = M;
          part_ml[row * 2 + 1] = L;
        }
      }
    }
    __syncthreads();
  }
}

// out[t, hq] = (sum_c acc_c e^(m_c - M)) / (sum_c l_c e^(m_c - M)) over row t's chunks in chunk order,
// times sigmoid(gate[t, hq]) when use_gate. One CTA per (row, query head), one thread per dim.
extern "C" __global__ void __launch_bounds__(D)
    attn_decode_merge(const float* __restrict__ part_acc,  // [T, nh, nch, D]
                      const float* __restrict__ part_ml,   // [T, nh, nch, 2]
                      const int* __restrict__ length, const long long* __restrict__ mask,
                      const bf16* __restrict__ gate,  // [T, nh, D] (read only when use_gate)
                      bf16* __restrict__ out,         // [T, nh, D]
                      int nh, int nch, int use_gate) {
  const int t = blockIdx.x / nh, k = threadIdx.x;
  const int n = *length + __popcll((u64)mask[t]);
  const int nc = min((n + CHUNK - 1) / CHUNK, nch);
  const size_t base = (size_t)blockIdx.x * nch;
  float M = -INFINITY;
  for (int c = 0; c < nc; ++c) M = fmaxf(M, part_ml[(base + c) * 2]);
  float L = 0.0f, A = 0.0f;
  for (int c = 0; c < nc; ++c) {
    const float f = expf(part_ml[(base + c) * 2] - M);
    L = fmaf(part_ml[(base + c) * 2 + 1], f, L);
    A = fmaf(part_acc[(base + c) * D + k], f, A);
  }
  float o = A / L;
  if (use_gate) {
    const float g = __bfloat162float(gate[(size_t)blockIdx.x * D + k]);
    o = o / (1.0f + expf(-g));
  }
  out[(size_t)blockIdx.x * D + k] = __float2bfloat16_rn(o);
}
