// Token sampling on the GPU: greedy argmax or Gumbel-max over temperature / top-k / top-p filtered logits,
// with noise keyed by (seed, absolute position, vocab index) exactly as lumo/engine/sampling.py.
//
// Row modes (per row, from device tensors; same rules as SamplingParams / filter_logits):
//   greedy   (temperature <= 0 or top_k == 1): argmax of the (penalised) logits, lowest index on ties.
//   plain    (no top-k, top-p, min-p): argmax over all V of x + g, x = logit / temperature (IEEE division).
//   filtered (0 < top_k < V, top_p < 1 or min-p on): the C largest x (C = NCAND) are the candidates;
//            min-p keeps x with f32(x - max) >= log(min_p) (the threshold computed on the host), top-k
//            keeps x >= x[k-1] (k clamped to C), top-p keeps tokens whose exclusive cumulative softmax
//            mass is < top_p (first always kept; the softmax denominator covers all V unless top-k or
//            min-p is on: then the kept candidates), then argmax of x + g over the kept candidates.
// min_tokens (lumo.engine.sampling.sample): a row sampling a position below ban_until[t] first sets the stop
// tokens' logits (stop_mask[i] != 0) to -inf.
// Logit bias and penalties (lumo.engine.sampling.adjust): a row with its bias flag set then adds bias[i]
// (every i: x + 0 where nothing is biased, as the CPU sampler adds its vector); a row is penalised when
// repetition != 1, frequency != 0 or presence != 0: then each logit becomes, with c = counts[i] + how often
// i is among the row's path tokens and seen = prompt[i] or c > 0,
//   x = seen ? (x > 0 ? x / rep : x * rep) : x;  x = x - freq * c;  x = x - pres * (c > 0)
// one IEEE rounding per operation, as torch's. counts is the slot's generated-token histogram; a tree row's
// path tokens are the drafted tokens of its path below the root (node ids path[t, 0..E), tokens from
// node_tokens), so each row sees what plain decoding has generated at its position.
// Noise: h = fmix32(fmix32(idx ^ key) ^ seed_hi), u = ((h >> 9) + 0.5) * 2^-23 (exact, in (0, 1)),
//   g = rn32(-log(rn32(-log(u)))) with each log in double, so every step is the correctly rounded fp32
//   value (the double results are >= 49 double ulps from any fp32 rounding boundary for all 2^23 inputs,
//   checked in tests/test_sampling_gpu.py), bitwise equal to the CPU sampler's double-based formula.
//
// Two passes: sample_partial (grid (NB, T), CTA b owns [b*SPAN, (b+1)*SPAN)) writes per-CTA argmax /
// (max, sum exp) / top-C candidates; sample_final (one CTA per row) combines them in CTA order and, given
// count_out, adds each row's token to that histogram (the runner's step: the token it emits). Every
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
#define KFAST 64     // top-k rows with k <= KFAST take their candidates by warp merges, not sorts
#define PER_THREAD (SPAN / THREADS)

#include "logits.cuh"
#include "pdl.cuh"
#include "penalty.cuh"

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
  if (b == 0x80000000u) b = 0u;  // -0 == +0: one value (ties by index, as torch's stable sort; top-k's ties)
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
  bool greedy, use_k, use_p, use_min_p, filtered;
  float temp, min_p;  // min_p: the log threshold (-inf: off)
  int k;
};

__device__ __forceinline__ Mode row_mode(const float* temperature, const int* top_k, const float* top_p,
                                         const float* min_p, int t, int V) {
  Mode m;
  m.temp = temperature[t];
  const int k = top_k[t];
  const float p = top_p[t];
  m.min_p = min_p == nullptr ? -INFINITY : min_p[t];
  m.greedy = !(m.temp > 0.0f) || k == 1;
  m.use_k = k > 0 && k < V;
  m.use_p = p < 1.0f;
  m.use_min_p = m.min_p > -INFINITY;
  m.filtered = !m.greedy && (m.use_k || m.use_p || m.use_min_p);
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

// The largest of the lanes' keys (u64: a total order; every lane gets it).
__device__ __forceinline__ u64 warp_max_key(u64 v) {
  for (int o = 16; o > 0; o >>= 1) {
    const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// A top-k row's candidate list (k <= KFAST): keys in descending order, the k largest and then every
// further key with the k-th's value (top-k keeps ties: x >= x[k-1]), at most NCAND: the first entries of
// the NCAND-key list the sorts would give, and nothing of it that top-k keeps is missing. One warp walks
// its lists: every lane holds the head of its own list (next(): advance it, return the new head, 0 at
// the end), and each round takes the warp's largest head. emit(n, key) stores entry n; returns the count.
template <typename Next, typename Emit>
__device__ int warp_merge_topk(u64 head, int k, Next next, Emit emit) {
  u64 kth = 0ull;
  int n = 0;
  while (n < NCAND) {
    const u64 w = warp_max_key(head);
    if (w == 0ull || (n >= k && (w >> 32) != (kth >> 32))) break;  // (the high word is the value)
    emit(n, w);
    if (n == k - 1) kth = w;
    ++n;
    if (head == w) head = next();  // keys are unique: one lane
  }
  return n;
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
                   const float* __restrict__ min_p,         // [T] log threshold, -inf: off; or null
                   const float* __restrict__ penalty,       // [T, 4] repetition, frequency, presence, bias on
                   const float* __restrict__ bias,          // [V] logit bias, or null
                   const unsigned char* __restrict__ stop_mask,  // [V] 1: a stop token (min_tokens), or null
                   const long long* __restrict__ ban_until,      // [T] stop tokens banned below it, or null
                   const int* __restrict__ counts,          // [V] generated-token histogram
                   const unsigned char* __restrict__ prompt,  // [V] 1: in the prompt
                   const int* __restrict__ path,            // [T, E] path node ids (-1: none), or null
                   const int* __restrict__ node_tokens,     // [>= max node id + 1] token of each node
                   int E,
                   float* __restrict__ part_val,  // [T, NB] argmax value or chunk max
                   int* __restrict__ part_idx,    // [T, NB] argmax index
                   float* __restrict__ part_sum,  // [T, NB] sum exp(x - chunk max)
                   u64* __restrict__ part_keys,   // [T, NB, NCAND]
                   int V, int NB) {
  pdl_begin();
  __shared__ u64 buf[SORTN];
  __shared__ float sv[THREADS / 32];
  __shared__ int si[THREADS / 32];
  __shared__ int ptok[PATH_MAX];
  const int b = blockIdx.x, t = blockIdx.y;
  const Mode md = row_mode(temperature, top_k, top_p, min_p, t, V);
  Penalty pen = row_penalty(penalty, bias, t);
  pen.ban = row_bans(stop_mask, ban_until, t, position[t]);
  const int np = path == nullptr ? 0 : E;
  if (pen.on) {
    for (int e = threadIdx.x; e < np; e += THREADS) {
      const int node = path[(size_t)t * E + e];
      ptok[e] = node >= 0 ? node_tokens[node] : -1;
    }
    __syncthreads();
  }
  const logit_t* lrow = logits + (size_t)t * V;
  auto row = [&](int i) {
    float x = logit_f32(lrow[i]);
    if (pen.ban && stop_mask[i]) x = -INFINITY;
    if (pen.bias) x = __fadd_rn(x, bias[i]);
    if (!pen.on) return x;
    int c = counts[i];
    for (int e = 0; e < np; ++e) c += ptok[e] == i;
    return penalized(x, c, prompt[i] != 0, pen);
  };
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
  if (md.use_k && md.k <= KFAST) {
    // Each warp merges its lanes' keys (PER_THREAD each, consumed largest first) into its list in buf,
    // then warp 0 merges the 16 lists into part_keys; part_idx holds the count (sample_final).
    __shared__ int wcount[THREADS / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u64 mine[PER_THREAD];
    u64 best = 0ull;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int i = lo + threadIdx.x + j * THREADS;
      mine[j] = i < hi ? make_key(row(i) / md.temp, (u32)i) : 0ull;
      best = mine[j] > best ? mine[j] : best;
    }
    auto next_mine = [&]() {  // drop the lane's largest key (the one just taken), return the next
      u64 b = 0ull;
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) {
        mine[j] = mine[j] == best ? 0ull : mine[j];
        b = mine[j] > b ? mine[j] : b;
      }
      return best = b;
    };
    u64* list = buf + warp * NCAND;
    const int n = warp_merge_topk(best, md.k, next_mine, [&](int j, u64 key) {
      if (lane == 0) list[j] = key;
    });
    if (lane == 0) wcount[warp] = n;
    __syncthreads();
    if (warp == 0) {
      const int cnt = lane < THREADS / 32 ? wcount[lane] : 0;
      int h = 0;
      auto next_list = [&]() { return ++h < cnt ? buf[lane * NCAND + h] : 0ull; };
      const int m = warp_merge_topk(cnt > 0 ? buf[lane * NCAND] : 0ull, md.k, next_list, [&](int j, u64 key) {
        if (lane == 0) part_keys[pi * NCAND + j] = key;
      });
      if (lane == 0) part_idx[pi] = m;
    }
    return;
  }
  top_candidates(buf, hi - lo, [&](int i) { return make_key(row(lo + i) / md.temp, (u32)(lo + i)); });
  for (int i = threadIdx.x; i < NCAND; i += THREADS) part_keys[pi * NCAND + i] = buf[i];
}

extern "C" __global__ void __launch_bounds__(THREADS)
    sample_final(const float* __restrict__ temperature, const int* __restrict__ top_k,
                 const float* __restrict__ top_p, const long long* __restrict__ seed,
                 const long long* __restrict__ position, const float* __restrict__ min_p,
                 const float* __restrict__ part_val, const int* __restrict__ part_idx,
                 const float* __restrict__ part_sum, const u64* __restrict__ part_keys,
                 int* __restrict__ tokens,     // [T] int32
                 int* __restrict__ count_out,  // [V] histogram the tokens are added to, or null
                 int V, int NB) {
  pdl_begin();
  __shared__ u64 buf[SORTN];
  __shared__ float prob[NCAND];
  __shared__ float sv[THREADS / 32];
  __shared__ int si[THREADS / 32];
  const int t = blockIdx.x;
  const Mode md = row_mode(temperature, top_k, top_p, min_p, t, V);
  const size_t p0 = (size_t)t * NB;
  auto emit = [&](int tok) {
    tokens[t] = tok;
    if (count_out != nullptr) atomicAdd(count_out + tok, 1);
  };
  if (!md.filtered) {
    if (threadIdx.x == 0) {
      float bv = -INFINITY;
      int bi = 0x7FFFFFFF;
      for (int b = 0; b < NB; ++b)
        if (better(part_val[p0 + b], part_idx[p0 + b], bv, bi)) bv = part_val[p0 + b], bi = part_idx[p0 + b];
      emit(bi == 0x7FFFFFFF ? 0 : bi);
    }
    return;
  }
  if (md.use_k && md.k <= KFAST) {
    // The partials' lists (part_idx: their counts) merged by one warp, a lane per list, from shared
    // memory; more than 32 lists or too long ones: the sorts over the lists (entries past a count are 0).
    int longest = 0;
    for (int b = 0; b < NB; ++b) longest = max(longest, part_idx[p0 + b]);
    if (NB <= 32 && NB * longest <= SORTN) {
      __shared__ u64 top[NCAND];
      for (int i = threadIdx.x; i < NB * longest; i += THREADS) {
        const int b = i / longest, j = i % longest;
        buf[i] = j < part_idx[p0 + b] ? part_keys[(p0 + b) * NCAND + j] : 0ull;
      }
      for (int i = threadIdx.x; i < NCAND; i += THREADS) top[i] = 0ull;
      __syncthreads();
      if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int h = 0;
        auto next_list = [&]() { return ++h < longest && lane < NB ? buf[lane * longest + h] : 0ull; };
        const u64 first = lane < NB && longest > 0 ? buf[lane * longest] : 0ull;
        warp_merge_topk(first, md.k, next_list, [&](int j, u64 key) {
          if (lane == 0) top[j] = key;
        });
      }
      __syncthreads();
      for (int i = threadIdx.x; i < NCAND; i += THREADS) buf[i] = top[i];
      __syncthreads();
    } else {
      top_candidates(buf, NB * NCAND, [&](int i) {
        return i % NCAND < part_idx[p0 + i / NCAND] ? part_keys[p0 * NCAND + i] : 0ull;
      });
    }
  } else {
    top_candidates(buf, NB * NCAND, [&](int i) { return part_keys[p0 * NCAND + i]; });
  }
  const int c = threadIdx.x;  // one candidate per thread (NCAND <= THREADS)
  const u64 key = c < NCAND ? buf[c] : 0ull;
  const float x = key_value(key);
  const float top = key_value(buf[0]);
  const float kth = key_value(buf[md.k - 1]);
  // A candidate passes min-p and top-k (min-p first, vLLM's order; they commute on what they keep).
  auto passes = [&](u64 k, float xi) {
    return k != 0ull && (!md.use_min_p || __fsub_rn(xi, top) >= md.min_p) && (!md.use_k || xi >= kth);
  };
  bool kept = c < NCAND && passes(key, x);
  if (md.use_p) {
    float z = 0.0f;  // softmax denominator relative to the max `top`
    if (md.use_k || md.use_min_p) {
      for (int i = 0; i < NCAND; ++i) {
        const float xi = key_value(buf[i]);
        if (passes(buf[i], xi)) z += expf(xi - top);
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
  if (threadIdx.x == 0) emit(i == 0x7FFFFFFF ? 0 : i);
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
