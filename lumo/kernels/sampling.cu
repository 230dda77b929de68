// Token sampling on the GPU: greedy argmax or Gumbel-max over temperature / top-k / top-p filtered logits,
// with noise keyed by (seed, absolute position, vocab index) exactly as lumo/engine/sampling.py.
//
// Row modes (per row, from device tensors; same rules as SamplingParams / filter_logits):
//   greedy   (temperature <= 0 or top_k == 1): argmax of the raw logits, lowest index on ties.
//   plain    (no top-k, no top-p): argmax over all V of x + g, x = logit / temperature (IEEE division).
//   filtered (0 < top_k < V or top_p < 1): the C largest x (C = NCAND) are the candidates; top-k keeps
//            x >= x[k-1] (k clamped to C), top-p keeps tokens whose exclusive cumulative softmax mass is
//            < top_p (first always kept; the softmax denominator covers all V unless top-k is on), then
//            argmax of x + g over the kept candidates.
// Noise: h = fmix32(fmix32(idx ^ key) ^ seed_hi), u = ((h >> 9) + 0.5) * 2^-23 (exact, in (0, 1)),
//   g = rn32(-log(rn32(-log(u)))) with each log in double, so every step is the correctly rounded fp32
//   value (the double results are >= 49 double ulps from any fp32 rounding boundary for all 2^23 inputs,
//   checked in tests/test_sampling_gpu.py), bitwise equal to the CPU sampler's double-based formula.
//
// Two passes: sample_partial (grid (NB, T), CTA b owns [b*SPAN, (b+1)*SPAN)) writes per-CTA argmax /
// (max, sum exp) / top-C candidates; sample_final (one CTA per row) combines them in CTA order. Every
// reduction has a fixed shape independent of T (batch invariant); argmax is order independent anyway.
//
// Logits are f32, or bf16 with LOGITS_BF16=1 (logits.cuh).
//
// lumo:test-defines NCAND=256
// lumo:test-defines NCAND=256 LOGITS_BF16=1

#ifndef NCAND
#define NCAND 256  // candidates kept per row for top-k / top-p
#endif
#define SPAN 8192     // vocab entries per partial CTA
#define THREADS 512
#define SORTN 4096  // bitonic sort buffer (keys)

#include "logits.cuh"
#include "pdl.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ u32 fmix32(u32 h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

__device__ __forceinline__ u32 row_key(u64 seed, u64 position) {
  const u32 k0 = fmix32((u32)seed ^ 0x9E3779B9u);
  return fmix32(k0 ^ fmix32((u32)position * 0x632BE5ABu));
}

__device__ __forceinline__ float uniform_of(u32 idx, u32 key, u32 seed_hi) {
  const u32 h = fmix32(fmix32(idx ^ key) ^ seed_hi);
  return ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

__device__ __forceinline__ float gumbel_of(float u) {
  const float e = __double2float_rn(-log((double)u));
  return __double2float_rn(-log((double)e));
}

// Larger key = larger x, then lower index: keys are unique and their order is (x desc, index asc), the
// order of a stable descending sort. Key 0 is padding (below every real key).
__device__ __forceinline__ u64 make_key(float x, u32 idx) {
  u32 b = __float_as_uint(x);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ((u64)b << 32) | (u64)(~idx);
}
__device__ __forceinline__ float key_value(u64 k) {
  u32 b = (u32)(k >> 32);
  b = (b & 0x80000000u) ? (b & 0x7FFFFFFFu) : ~b;
  return __uint_as_float(b);
}
__device__ __forceinline__ u32 key_index(u64 k) { return ~(u32)k; }

struct Mode {
  bool greedy, use_k, use_p, filtered;
  float temp;
  int k;
};

__device__ __forceinline__ Mode row_mode(const float* temperature, const int* top_k, const float* top_p, int t,
                                         int V) {
  Mode m;
  m.temp = temperature[t];
  const int k = top_k[t];
  const float p = top_p[t];
  m.greedy = !(m.temp > 0.0f) || k == 1;
  m.use_k = k > 0 && k < V;
  m.use_p = p < 1.0f;
  m.filtered = !m.greedy && (m.use_k || m.use_p);
  m.k = m.use_k ? min(k, NCAND) : NCAND;
  return m;
}

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// Block argmax (val, idx): order independent (a total order), so the reduction shape is irrelevant.
__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
  const int w = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) sv[w] = v, si[w] = i;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < THREADS / 32; ++k)
      if (better(sv[k], si[k], sv[0], si[0])) sv[0] = sv[k], si[0] = si[k];
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
  __syncthreads();
}

// Bitonic sort of SORTN keys in shared memory, descending.
__device__ void bitonic_sort_desc(u64* a) {
  for (int size = 2; size <= SORTN; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < SORTN / 2; i += THREADS) {
        const int lo = 2 * i - (i & (stride - 1));
        const int hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const u64 x = a[lo], y = a[hi];
        if ((x < y) == desc) a[lo] = y, a[hi] = x;
      }
      __syncthreads();
    }
  }
}

// Top NCAND keys of n keys produced by get(i), i in [0, n): sorted descending in buf[0, NCAND).
// buf[0, NCAND) carries the running top; each round fills the rest with new keys and sorts.
template <typename F>
__device__ void top_candidates(u64* buf, int n, F get) {
  for (int i = threadIdx.x; i < NCAND; i += THREADS) buf[i] = 0ull;
  for (int base = 0; base < n; base += SORTN - NCAND) {
    __syncthreads();
    for (int i = threadIdx.x; i < SORTN - NCAND; i += THREADS)
      buf[NCAND + i] = base + i < n ? get(base + i) : 0ull;
    __syncthreads();
    bitonic_sort_desc(buf);
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS)
    sample_partial(const logit_t* __restrict__ logits,  // [T, V]
                   const float* __restrict__ temperature, const int* __restrict__ top_k,
                   const float* __restrict__ top_p, const long long* __restrict__ seed,
                   const long long* __restrict__ position,  // [T] each
                   float* __restrict__ part_val,            // [T, NB] argmax value or chunk max
                   int* __restrict__ part_idx,              // [T, NB] argmax index
                   float* __restrict__ part_sum,            // [T, NB] sum exp(x - chunk max)
                   u64* __restrict__ part_keys,             // [T, NB, NCAND]
                   int V, int NB) {
  pdl_begin();
  __shared__ u64 buf[SORTN];
  __shared__ float sv[THREADS / 32];
  __shared__ int si[THREADS / 32];
  const int b = blockIdx.x, t = blockIdx.y;
  const Mode md = row_mode(temperature, top_k, top_p, t, V);
  const logit_t* lrow = logits + (size_t)t * V;
  auto row = [&](int i) { return logit_f32(lrow[i]); };
  const int lo = b * SPAN, hi = min(V, lo + SPAN);
  const size_t pi = (size_t)t * NB + b;

  if (!md.filtered) {
    const u32 key = row_key((u64)seed[t], (u64)position[t]);
    const u32 seed_hi = (u32)((u64)seed[t] >> 32);
    float bv = -INFINITY;
    int bi = 0x7FFFFFFF;
    for (int i = lo + threadIdx.x; i < hi; i += THREADS) {
      float v = row(i);
      if (!md.greedy) v = v / md.temp + gumbel_of(uniform_of((u32)i, key, seed_hi));
      if (better(v, i, bv, bi)) bv = v, bi = i;
    }
    block_argmax(bv, bi, sv, (int*)si);
    if (threadIdx.x == 0) part_val[pi] = bv, part_idx[pi] = bi;
    return;
  }
  if (md.use_p && !md.use_k) {
    // Softmax denominator over all V: chunk max, then sum exp(x - max) with a fixed thread/tree order.
    float mx = -INFINITY;
    int unused = 0;
    for (int i = lo + threadIdx.x; i < hi; i += THREADS) mx = fmaxf(mx, row(i) / md.temp);
    block_argmax(mx, unused, sv, (int*)si);
    float s = 0.0f;
    if (mx > -INFINITY)
      for (int i = lo + threadIdx.x; i < hi; i += THREADS) s += expf(row(i) / md.temp - mx);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) sv[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      float tot = 0.0f;
      for (int k = 0; k < THREADS / 32; ++k) tot += sv[k];
      part_val[pi] = mx;
      part_sum[pi] = tot;
    }
    __syncthreads();
  }
  top_candidates(buf, hi - lo, [&](int i) { return make_key(row(lo + i) / md.temp, (u32)(lo + i)); });
  for (int i = threadIdx.x; i < NCAND; i += THREADS) part_keys[pi * NCAND + i] = buf[i];
}

extern "C" __global__ void __launch_bounds__(THREADS)
    sample_final(const float* __restrict__ temperature, const int* __restrict__ top_k,
                 const float* __restrict__ top_p, const long long* __restrict__ seed,
                 const long long* __restrict__ position, const float* __restrict__ part_val,
                 const int* __restrict__ part_idx, const float* __restrict__ part_sum,
                 const u64* __restrict__ part_keys,
                 int* __restrict__ tokens,  // [T] int32
                 int V, int NB) {
  pdl_begin();
  __shared__ u64 buf[SORTN];
  __shared__ float prob[NCAND];
  __shared__ float sv[THREADS / 32];
  __shared__ int si[THREADS / 32];
  const int t = blockIdx.x;
  const Mode md = row_mode(temperature, top_k, top_p, t, V);
  const size_t p0 = (size_t)t * NB;
  if (!md.filtered) {
    if (threadIdx.x == 0) {
      float bv = -INFINITY;
      int bi = 0x7FFFFFFF;
      for (int b = 0; b < NB; ++b)
        if (better(part_val[p0 + b], part_idx[p0 + b], bv, bi)) bv = part_val[p0 + b], bi = part_idx[p0 + b];
      tokens[t] = bi == 0x7FFFFFFF ? 0 : bi;
    }
    return;
  }
  top_candidates(buf, NB * NCAND, [&](int i) { return part_keys[p0 * NCAND + i]; });
  const int c = threadIdx.x;  // one candidate per thread (NCAND <= THREADS)
  const u64 key = c < NCAND ? buf[c] : 0ull;
  const float x = key_value(key);
  const float top = key_value(buf[0]);
  const float kth = key_value(buf[md.k - 1]);
  bool kept = c < NCAND && key != 0ull && (!md.use_k || x >= kth);
  if (md.use_p) {
    float z = 0.0f;  // softmax denominator relative to the max `top`
    if (md.use_k) {
      for (int i = 0; i < NCAND; ++i) {
        const float xi = key_value(buf[i]);
        if (buf[i] != 0ull && xi >= kth) z += expf(xi - top);
      }
    } else {
      for (int b = 0; b < NB; ++b)
        if (part_val[p0 + b] > -INFINITY) z += part_sum[p0 + b] * expf(part_val[p0 + b] - top);
    }
    const float pr = kept ? expf(x - top) / z : 0.0f;
    if (c < NCAND) prob[c] = pr;
    __syncthreads();
    // Inclusive scan in candidate order (Hillis-Steele, fixed shape).
    for (int o = 1; o < NCAND; o <<= 1) {
      const float add = (c < NCAND && c >= o) ? prob[c - o] : 0.0f;
      __syncthreads();
      if (c < NCAND) prob[c] += add;
      __syncthreads();
    }
    const float before = c < NCAND ? prob[c] - pr : 0.0f;
    kept = kept && (c == 0 || before < top_p[t]);
  }
  float v = -INFINITY;
  int i = 0x7FFFFFFF;
  if (kept) {
    const u32 rk = row_key((u64)seed[t], (u64)position[t]);
    i = (int)key_index(key);
    v = x + gumbel_of(uniform_of((u32)i, rk, (u32)((u64)seed[t] >> 32)));
  }
  block_argmax(v, i, sv, si);
  if (threadIdx.x == 0) tokens[t] = i == 0x7FFFFFFF ? 0 : i;
}

// Test hook: u and g for indices [0, n) of one (seed, position); raw = 1 uses u's 23-bit integer = index.
extern "C" __global__ void sample_noise(const long long* __restrict__ seed, const long long* __restrict__ position,
                                        int n, int raw, float* __restrict__ u_out, float* __restrict__ g_out) {
  pdl_begin();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const u32 key = row_key((u64)seed[0], (u64)position[0]);
  const float u = raw ? ((float)i + 0.5f) * (1.0f / 8388608.0f) : uniform_of((u32)i, key, (u32)((u64)seed[0] >> 32));
  u_out[i] = u;
  g_out[i] = gumbel_of(u);
}
