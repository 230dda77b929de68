// Decode / tree-verify attention: T query rows (1 = plain decode, <= 32 tree rows) against one KV cache slot.
//
// Keys of row t, in logical position order: the committed prefix [0, len) (cache slot p = position p), then
// the tree slots whose bit is set in mask[t], in slot order (parents precede children, so slot order is depth
// order): the k-th set bit j sits at logical position len + k. Row t sees n_t = len + popcount(mask[t]) keys.
//
// Split-K over FIXED chunks of logical positions: chunk c = positions [c*CHUNK, (c+1)*CHUNK), whatever len
// and T are. Inside a chunk, warp `sub` owns positions [c*CHUNK + sub*SUB, +SUB): it computes their scores,
// max, exps, sum and P.V in position order; the NSUB sub-partials are combined in sub order, the chunks by
// attn_decode_merge in chunk order. Everything a row computes is a function of (its q, its n_t keys in
// position order) only: T, the row's index and the other rows never enter its arithmetic (batch invariant),
// and a tree row equals the plain decode of the same token after its ancestors were committed.
//
// Work split: CTA = (kv head, row, chunk slot). Rows are a grid dimension, so T tree rows run in parallel
// (their K/V reads of the shared prefix hit L2). The grid's chunk slots are a launch choice: CTA z walks
// chunks z, z + gridDim.z, ... while they hold keys of its row, so a captured graph replays for any len and
// the grid need not be sized by the cache capacity. Slots are the slowest grid dimension: the CTAs with
// work (low slots) are dispatched first, the ones past a short cache last, where they only exit. One warp computes all G query heads of the group for
// its sub-chunk: a K/V row is loaded once (lane = DPL contiguous dims, 16 B for d = 256) and used G times.
// Latency: a warp loads NB keys' rows at once (NB independent 16-byte loads per lane in flight) before it
// uses any; the NB partial dot products of a head are reduced together by a transposing butterfly (each
// exchange halves the values a lane holds: NB - 1 + 5 - log2(NB) shuffles for NB keys, not 5 * NB).
//
// lumo:test-defines D=256 G=6
// lumo:test-defines D=64 G=2
// lumo:test-defines D=128 G=4

#include <cuda_bf16.h>

#include "pdl.cuh"

#ifndef D
#define D 256  // head dim
#endif
#ifndef G
#define G 6  // query heads per kv head (nh / nkv)
#endif
#define CHUNK 128  // positions per split-K partial (part of the arithmetic: fixed)
#define SUB 16     // positions per warp inside a chunk (part of the arithmetic: fixed)
#define NSUB (CHUNK / SUB)
#define NB 8  // keys loaded together (SUB % NB == 0)
#define DPL (D / 32)
#define THREADS (32 * NSUB)

static_assert(SUB % NB == 0 && NB == 8, "the transposing reduction below is written for NB = 8");

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;
#define INFINITY __int_as_float(0x7f800000)

// DPL contiguous bf16 of one lane in one vector load (16 B for d = 256, 8 B for 128, 4 B for d = 64).
#if DPL == 8
typedef uint4 Raw;
#elif DPL == 4
typedef uint2 Raw;
#elif DPL == 2
typedef unsigned int Raw;
#endif

union Vec {
  Raw raw;
  __nv_bfloat162 h[DPL / 2];
};

__device__ __forceinline__ void to_f32(const Vec& v, float* f) {
#pragma unroll
  for (int j = 0; j < DPL / 2; ++j) {
    const float2 x = __bfloat1622float2(v.h[j]);
    f[2 * j] = x.x;
    f[2 * j + 1] = x.y;
  }
}

__device__ __forceinline__ int kth_set_bit(u64 m, int k) {
  for (int i = 0; i < k; ++i) m &= m - 1;
  return __ffsll((long long)m) - 1;
}

// Full sums over the warp of NB = 8 per-lane values v[0..7] (key i's partial dot product in v[i]).
// Exchanges at lane distance 16, 8, 4 each hand half of the remaining keys to the partner; distances 2
// and 1 finish the last one. Lane L ends with key ((L >> 2) & 7)'s sum (all four lanes of that quad hold
// the same bits). The order of every addition is fixed by the lane and key indices alone.
// One exchange of reduce8: lanes with bit 4 * HALF set keep the upper HALF of the values they hold, the
// others the lower HALF; each sends its partner the half it drops and adds what it receives (keep + recv).
template <int HALF>
__device__ __forceinline__ void halve(float (&v)[8], int lane) {
  const bool hi = lane & (4 * HALF);
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float send = hi ? v[i] : v[i + HALF];
    const float keep = hi ? v[i + HALF] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 4 * HALF);
  }
}

__device__ __forceinline__ float reduce8(float (&v)[8], int lane) {
  halve<4>(v, lane);  // distance 16: 4 keys left per lane
  halve<2>(v, lane);  // distance 8: 2
  halve<1>(v, lane);  // distance 4: 1, key (lane >> 2) & 7
  float s = v[0];
  const float o2 = __shfl_xor_sync(0xffffffffu, s, 2);
  s = (lane & 2) ? o2 + s : s + o2;  // both lanes of a pair add in the same order: identical bits
  const float o1 = __shfl_xor_sync(0xffffffffu, s, 1);
  return (lane & 1) ? o1 + s : s + o1;
}

// Cache slot of logical position p of a row (p < n): the prefix, else its (p - len)-th tree slot.
__device__ __forceinline__ int slot_of(int p, int len, u64 mk) {
  return p < len ? p : len + kth_set_bit(mk, p - len);
}

// This lane's DPL dims of the K or V rows of NB keys at logical positions p .. p + NB - 1, all loads in
// flight together. Keys past the warp's `left` read as zero rows (no load; their scores are never used);
// so does an out-of-range slot (a caller error): no fault, but that key does take weight.
__device__ __forceinline__ void load_rows(Vec (&r)[NB], const bf16* base, size_t kv_row, int p, int left,
                                          int len, u64 mk, int max_len) {
#pragma unroll
  for (int i = 0; i < NB; ++i) {
    const int slot = i < left ? slot_of(p + i, len, mk) : max_len;
    if (slot < max_len) {
      r[i].raw = __ldg(reinterpret_cast<const Raw*>(base + (size_t)slot * kv_row));
    } else {
      r[i].raw = Raw{};
    }
  }
}

// Shared memory: per warp the scores / weights [SUB][G]; the NSUB sub-partials acc [NSUB][G][D] and
// (m, l) [NSUB][G][2].
#define SMEM_FLOATS (NSUB * SUB * G + NSUB * G * (D + 2))

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_decode_chunk(const bf16* __restrict__ q,          // [T, nkv*G, D]
                      const bf16* __restrict__ kc,         // [max_len, nkv, D]
                      const bf16* __restrict__ vc,         // [max_len, nkv, D]
                      const int* __restrict__ length,      // [1] committed positions len
                      const long long* __restrict__ mask,  // [T] tree-slot bitmask per row
                      float* __restrict__ part_acc,        // [T, nkv*G, nch, D]
                      float* __restrict__ part_ml,         // [T, nkv*G, nch, 2]
                      int nkv, int max_len, int nch) {
  extern __shared__ float smem[];  // SMEM_FLOATS (52.6 KB at d = 256, G = 6: dynamic)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.x, t = blockIdx.y, nh = nkv * G;
  const int len = *length;
  const u64 mk = (u64)mask[t];
  const int n = min(len + __popcll(mk), nch * CHUNK);  // keys of row t
  const int n_chunks = (n + CHUNK - 1) / CHUNK;
  if ((int)blockIdx.z >= n_chunks) return;  // uniform per CTA

  float* sc = smem + warp * (SUB * G);  // [SUB][G]
  float* pacc = smem + NSUB * SUB * G;  // [NSUB][G][D]
  float* pml = pacc + NSUB * G * D;     // [NSUB][G][2]
  const float scale = 1.0f / sqrtf((float)D);
  const size_t kv_row = (size_t)nkv * D;
  const bf16* kbase = kc + h * D + lane * DPL;
  const bf16* vbase = vc + h * D + lane * DPL;

  float qv[G][DPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    Vec v;
    v.raw = __ldg(reinterpret_cast<const Raw*>(q + ((size_t)t * nh + h * G + g) * D + lane * DPL));
    to_f32(v, qv[g]);
  }

  for (int c = blockIdx.z; c < n_chunks; c += gridDim.z) {
    const int p_begin = c * CHUNK + warp * SUB;
    const int cnt = max(0, min(SUB, n - p_begin));  // keys of this warp (warp-uniform)

    // Pass A: scores of the warp's keys, NB keys per round (loads first, then the dot products).
    for (int b = 0; b < cnt; b += NB) {
      Vec kv[NB];
      load_rows(kv, kbase, kv_row, p_begin + b, cnt - b, len, mk, max_len);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dots[NB];
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          float kf[DPL];
          to_f32(kv[i], kf);
          float s = 0.0f;
#pragma unroll
          for (int j = 0; j < DPL; ++j) s = fmaf(qv[g][j], kf[j], s);
          dots[i] = s;
        }
        const float s = reduce8(dots, lane) * scale;
        const int i = (lane >> 2) & 7;
        if ((lane & 3) == 0 && b + i < cnt) sc[(b + i) * G + g] = s;
      }
    }
    __syncwarp();
    // Max per head (exact whatever the order), then weights e^(s - m) in place and their sum in key order.
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -INFINITY;
      for (int i = 0; i < cnt; ++i) m[g] = fmaxf(m[g], sc[i * G + g]);
    }
    __syncwarp();
#pragma unroll
    for (int g = 0; g < G; ++g)
      for (int i = lane; i < cnt; i += 32) sc[i * G + g] = expf(sc[i * G + g] - m[g]);
    __syncwarp();
#pragma unroll
    for (int g = 0; g < G; ++g) {
      l[g] = 0.0f;
      for (int i = 0; i < cnt; ++i) l[g] += sc[i * G + g];
    }
    // Pass B: P.V in key order, NB value rows loaded per round.
    float acc[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[g][j] = 0.0f;
    for (int b = 0; b < cnt; b += NB) {
      Vec vv[NB];
      load_rows(vv, vbase, kv_row, p_begin + b, cnt - b, len, mk, max_len);
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        if (b + i >= cnt) break;
        float vf[DPL];
        to_f32(vv[i], vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float w = sc[(b + i) * G + g];
#pragma unroll
          for (int j = 0; j < DPL; ++j) acc[g][j] = fmaf(w, vf[j], acc[g][j]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int j = 0; j < DPL; ++j) pacc[(warp * G + g) * D + lane * DPL + j] = acc[g][j];
      if (lane == 0) {
        pml[(warp * G + g) * 2] = m[g];
        pml[(warp * G + g) * 2 + 1] = l[g];
      }
    }
    __syncthreads();
    // Combine the NSUB sub-partials in sub order (empty sub-chunks have m = -inf and contribute nothing).
    for (int i = threadIdx.x; i < G * D; i += THREADS) {
      const int g = i / D, k = i % D;
      float M = -INFINITY;
#pragma unroll
      for (int s = 0; s < NSUB; ++s) M = fmaxf(M, pml[(s * G + g) * 2]);
      float L = 0.0f, A = 0.0f;
#pragma unroll
      for (int s = 0; s < NSUB; ++s) {
        const float ms = pml[(s * G + g) * 2];
        const float f = ms == -INFINITY ? 0.0f : expf(ms - M);
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
    __syncthreads();  // the shared partials are rewritten by the next chunk
  }
}

// out[t, hq] = (sum_c acc_c e^(m_c - M)) / (sum_c l_c e^(m_c - M)) over row t's chunks in chunk order,
// times sigmoid(gate[t, hq]) when use_gate. One CTA per (row, query head), one thread per dim.
extern "C" __global__ void __launch_bounds__(D)
    attn_decode_merge(const float* __restrict__ part_acc,  // [T, nh, nch, D]
                      const float* __restrict__ part_ml,   // [T, nh, nch, 2]
                      const int* __restrict__ length, const long long* __restrict__ mask,
                      const bf16* __restrict__ gate,  // [T, nh, D], strides (gate_rs, gate_hs, 1)
                      long long gate_rs, int gate_hs, bf16* __restrict__ out,  // out [T, nh, D]
                      int nh, int nch, int use_gate) {
  pdl_trigger();  // the o projection (a PDL-launched GEMV) may start its weight prefetch
  const int t = blockIdx.x / nh, k = threadIdx.x;
  const int n = *length + __popcll((u64)mask[t]);
  const int nc = min((n + CHUNK - 1) / CHUNK, nch);
  const size_t base = (size_t)blockIdx.x * nch;
  float M = -INFINITY;
  for (int c = 0; c < nc; ++c) M = fmaxf(M, part_ml[(base + c) * 2]);
  float L = 0.0f, A = 0.0f;
#pragma unroll 8
  for (int c = 0; c < nc; ++c) {
    const float f = expf(part_ml[(base + c) * 2] - M);
    L = fmaf(part_ml[(base + c) * 2 + 1], f, L);
    A = fmaf(part_acc[(base + c) * D + k], f, A);
  }
  float o = A / L;
  if (use_gate) {
    const float g = __bfloat162float(gate[t * gate_rs + (long long)(blockIdx.x % nh) * gate_hs + k]);
    o = o / (1.0f + expf(-g));
  }
  out[(size_t)blockIdx.x * D + k] = __float2bfloat16_rn(o);
}
