// Log-probabilities of chosen tokens and of the k most likely tokens, for any number of logits rows in one
// launch (OpenAI's logprobs / top_logprobs; lumo/engine/logprobs.py).
//
//   logprob(i) = (x_i - m) - log(s),   m = max_j x_j,   s = sum_j exp(x_j - m)     (torch.log_softmax's form)
//
// lp_rows: grid (NB, T); CTA b owns vocab entries [b*SPAN, (b+1)*SPAN) of row t. Each thread walks its
//   entries (b*SPAN + i*THREADS + tid, i ascending) keeping an online (max, sum exp) and its KL best entries;
//   the warp combines its lanes by an xor butterfly, the CTA its warps in warp order, and it writes its
//   (m_b, s_b) and its KL best (value, index) to the workspace. The row's last CTA to finish (a counter per
//   row, reset by that CTA for the next launch) combines (m, s) over the CTAs in CTA order, merges the KL
//   best of all lists, and writes out[t] = [logprob(token[t]), logprob(best 1..k), index(best 1..k)].
//
// Batch invariance: a row's arithmetic depends on V alone (its CTAs and their shapes, the CTA-order
// combination whichever CTA finishes last), never on T or the row's place, so a row gets the same numbers
// alone (a plain decoding step) as among the accepted rows of a speculative event. "Best" is the strict
// total order (value descending, index ascending): the selected set and its order do not depend on how the
// lists are merged. Products and sums that the butterfly combines are written with __fmul_rn / __fadd_rn,
// so no contraction makes two lanes' results differ.
//
// Logits are f32, or bf16 with LOGITS_BF16=1 (logits.cuh). KL: entries kept per list (a launcher bucket
// >= the k asked for; 0: no alternatives).
//
// lumo:test-defines KL=0
// lumo:test-defines KL=20 LOGITS_BF16=1
// lumo:test-defines KL=4

#ifndef KL
#define KL 4
#endif
#define SPAN 8192  // vocab entries per CTA (the launcher's NB = ceil(V / SPAN))
#define THREADS 256
#define PER_THREAD (SPAN / THREADS)
#define WARPS (THREADS / 32)

#include "logits.cuh"
#include "pdl.cuh"

#define INFINITY __int_as_float(0x7f800000)
#define NO_INDEX 0x7fffffff  // an empty list slot: (-inf, NO_INDEX) loses to every entry

static_assert(KL >= 0 && KL <= 32, "KL in 0..32");

__device__ __forceinline__ bool better(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

// (m, s) <- the pair for the union of two sets of entries; commutative bit for bit.
__device__ __forceinline__ void ms_combine(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty (or all -inf): s stays 0
  s = __fadd_rn(__fmul_rn(s, expf(m - mx)), __fmul_rn(s2, expf(m2 - mx)));
  m = mx;
}

#if KL > 0
// A list sorted best first; insert (v, i) if it beats the last entry.
__device__ __forceinline__ void list_insert(float (&lv)[KL], int (&li)[KL], float v, int i) {
  if (!better(v, i, lv[KL - 1], li[KL - 1])) return;
  lv[KL - 1] = v;
  li[KL - 1] = i;
#pragma unroll
  for (int j = KL - 1; j > 0; --j) {
    if (better(lv[j], li[j], lv[j - 1], li[j - 1])) {
      const float tv = lv[j];
      const int ti = li[j];
      lv[j] = lv[j - 1];
      li[j] = li[j - 1];
      lv[j - 1] = tv;
      li[j - 1] = ti;
    }
  }
}

// The warp's KL best of its lanes' sorted lists, best first, in every lane's (ov, oi): KL rounds of a
// butterfly over the lanes' heads; the lane whose head won drops it.
__device__ __forceinline__ void warp_merge(float (&lv)[KL], int (&li)[KL], float (&ov)[KL], int (&oi)[KL]) {
#pragma unroll 1
  for (int r = 0; r < KL; ++r) {
    float v = lv[0];
    int i = li[0];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
      const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
      if (better(v2, i2, v, i)) {
        v = v2;
        i = i2;
      }
    }
    // Write slot r without a dynamic register index (an unrolled select keeps the lists in registers).
#pragma unroll
    for (int j = 0; j < KL; ++j) {
      if (j == r) {
        ov[j] = v;
        oi[j] = i;
      }
    }
    if (li[0] == i && i != NO_INDEX) {  // this lane's head won (indices are unique): drop it
#pragma unroll
      for (int j = 0; j + 1 < KL; ++j) {
        lv[j] = lv[j + 1];
        li[j] = li[j + 1];
      }
      lv[KL - 1] = -INFINITY;
      li[KL - 1] = NO_INDEX;
    }
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// lp_rows. grid (NB, T), block THREADS. x: row t at x + t * ld (V entries); token [T] i64; workspace:
// part_ms [T, NB, 2] f32 (m, s), part_v [T, NB, KL] f32, part_i [T, NB, KL] i32, counter [T] u32 (zero
// before the first launch; each launch leaves it zero); out [T, 1 + 2k] f32 (k <= KL alternatives).
extern "C" __global__ void __launch_bounds__(THREADS)
    lp_rows(const logit_t* __restrict__ x, long long ld, int V, int NB, const long long* __restrict__ token,
            float* part_ms, float* part_v, int* part_i, unsigned int* counter, float* __restrict__ out, int k) {
  __shared__ float sm[WARPS], ss[WARPS];
#if KL > 0
  __shared__ float sv[WARPS][KL];
  __shared__ int si[WARPS][KL];
#endif
  pdl_begin();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x, t = blockIdx.y;
  const logit_t* row = x + (long long)t * ld;
  const int lo = b * SPAN;
  float m = -INFINITY, s = 0.0f;
#if KL > 0
  float lv[KL], ov[KL];
  int li[KL], oi[KL];
#pragma unroll
  for (int j = 0; j < KL; ++j) {
    lv[j] = -INFINITY;
    li[j] = NO_INDEX;
  }
#endif
  float xv[PER_THREAD];
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int e = lo + i * THREADS + tid;
    xv[i] = e < V ? logit_f32(row[e]) : -INFINITY;
  }
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const float v = xv[i];
    if (v > m) {
      s = __fadd_rn(__fmul_rn(s, expf(m - v)), 1.0f);
      m = v;
    } else if (v != -INFINITY) {
      s = __fadd_rn(s, expf(v - m));
    }
#if KL > 0
    if (lo + i * THREADS + tid < V) list_insert(lv, li, v, lo + i * THREADS + tid);
#endif
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    ms_combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
#if KL > 0
  warp_merge(lv, li, ov, oi);
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < KL; ++j) {
      sv[warp][j] = ov[j];
      si[warp][j] = oi[j];
    }
  }
#endif
  __syncthreads();
  if (warp != 0) return;

  // This CTA's (m_b, s_b) and list, then the count of the row's CTAs done.
  const size_t p0 = (size_t)t * NB, p = p0 + b;
  if (lane == 0) {
    float cm = sm[0], cs = ss[0];
    for (int w = 1; w < WARPS; ++w) ms_combine(cm, cs, sm[w], ss[w]);  // warp order: fixed
    part_ms[2 * p] = cm;
    part_ms[2 * p + 1] = cs;
  }
#if KL > 0
#pragma unroll
  for (int j = 0; j < KL; ++j) {
    lv[j] = lane < WARPS ? sv[lane][j] : -INFINITY;
    li[j] = lane < WARPS ? si[lane][j] : NO_INDEX;
  }
  warp_merge(lv, li, ov, oi);
#pragma unroll
  for (int j = 0; j < KL; ++j) {
    if (j == lane) {
      part_v[p * KL + j] = ov[j];
      part_i[p * KL + j] = oi[j];
    }
  }
#endif
  __threadfence();  // each lane's partials before the count (the last CTA reads them) ...
  __syncwarp();     // ... and every lane's fence before lane 0 counts
  unsigned int done = 0;
  if (lane == 0) done = atomicAdd(counter + t, 1u);
  if (__shfl_sync(0xffffffffu, done, 0) != (unsigned int)NB - 1) return;

  // The row's last CTA: every partial is written (the other CTAs fenced before counting). They are read
  // through L2 (__ldcg): an earlier launch may have left this workspace's lines in this SM's L1.
  __threadfence();
  if (lane == 0) counter[t] = 0u;  // for the next launch (stream order: nothing else runs this row now)
  m = -INFINITY;
  s = 0.0f;
  for (int c = 0; c < NB; ++c)
    ms_combine(m, s, __ldcg(part_ms + 2 * (p0 + c)), __ldcg(part_ms + 2 * (p0 + c) + 1));
  const float ls = logf(s);
  float* o = out + (size_t)t * (1 + 2 * k);
  if (lane == 0) o[0] = __fsub_rn(__fsub_rn(logit_f32(row[token[t]]), m), ls);
#if KL > 0
#pragma unroll
  for (int j = 0; j < KL; ++j) {
    lv[j] = -INFINITY;
    li[j] = NO_INDEX;
  }
  for (int c = lane; c < NB; c += 32)
#pragma unroll
    for (int j = 0; j < KL; ++j)
      list_insert(lv, li, __ldcg(part_v + (p0 + c) * KL + j), __ldcg(part_i + (p0 + c) * KL + j));
  warp_merge(lv, li, ov, oi);
#pragma unroll
  for (int j = 0; j < KL; ++j) {
    if (j == lane && j < k) {
      o[1 + j] = __fsub_rn(__fsub_rn(ov[j], m), ls);
      o[1 + k + j] = (float)oi[j];
    }
  }
#endif
}
