// Chunked Gated DeltaNet prefill (the WY / UT form of lumo.model.gdn_chunked), fp32 operands: the
// prompt's tokens in chunks of GC = 64; per chunk n and value head h, with l_t the cumulative log decay
// inside the chunk (l_t <= 0, non-increasing), Γ_t = exp(l_t), γ = exp(l_last):
//
//   gdn_chunk_prep  (grid (chunks, NV), 256 threads; all chunks of a piece of the prompt at once)
//     A_tj = β_t (k_t . k_j) exp(l_t - l_j) for j < t;  [W | U] = (I + A)^-1 [β Γ k | β v]  (forward
//     substitution, one column per thread, in registers), P_tj = (q_t . k_j) exp(l_t - l_j) for j <= t,
//     Qg_t = Γ_t q_t, K~_t = exp(l_last - l_t) k_t, γ; written to the workspace (fp32, CHUNK_FLOATS per
//     (chunk, head)).
//   gdn_chunk_scan  (grid (DV / DVS, NV), SPR * 64 threads; one walk over the chunks, CUDA cores)
//     the [DK, DVS] state tile S in shared memory; per chunk: Uc = U - W S, o = Qg S + P Uc,
//     S = γ S + K~^T Uc. Writes o [T, NV, DV] and the final state.
//   gdn_chunk_scan_tc  (DK % 64 == 0: the same walk on tensor cores, at the end of this file)
//
// q, k are l2-normalised (eps 1e-6), q scaled by DK^-0.5, g = -exp(A_log) softplus(a + dt_bias) (identity
// above 20), β = sigmoid(b), as gdn_step.cuh; padded tokens past T have q = k = v = 0, g = β = 0, so they
// change nothing. Every exponent taken is <= 0. Not bitwise the sequential kernel (another summation
// order); the launcher (gdn.py gdn_prefill) and tests bound the difference. Launched without PDL (the
// prefill's GEMMs are cuBLAS's anyway), so these kernels need no pdl_wait.
//
// lumo:test-defines NK=16 NV=48 DK=128 DV=128 DVS=16 PARAM_BF16=0 OUT_BF16=1
// lumo:test-defines NK=2 NV=4 DK=64 DV=64 DVS=16 PARAM_BF16=1 OUT_BF16=0
// lumo:test-defines NK=2 NV=6 DK=32 DV=24 DVS=8 PARAM_BF16=0 OUT_BF16=0
// lumo:test-defines NK=16 NV=48 DK=128 DV=128 DVS=16 PARAM_BF16=0 OUT_BF16=1 SPR=4
// lumo:test-defines NK=2 NV=4 DK=64 DV=40 DVS=8 PARAM_BF16=0 OUT_BF16=1 TF32_PASSES=1
// lumo:test-defines NK=16 NV=48 DK=128 DV=128 DVS=32 PARAM_BF16=0 OUT_BF16=1

#include <cuda_bf16.h>

#include "mma.cuh"

#ifndef NK
#define NK 16
#endif
#ifndef NV
#define NV 48
#endif
#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#ifndef DVS
#define DVS 16  // state columns per scan CTA
#endif
#ifndef PARAM_BF16
#define PARAM_BF16 0
#endif
#ifndef OUT_BF16
#define OUT_BF16 1
#endif

#define GC 64  // tokens per chunk
#define PREP_THREADS 256
#ifndef SPR
#define SPR 2  // gdn_chunk_scan threads per chunk row (a speed choice: every value's arithmetic is its own)
#endif
#define SCAN_THREADS (SPR * GC)
// Workspace floats per (chunk, head): W [GC][DK], U [GC][DV], Qg [GC][DK], K~^T [DK][GC], P [GC][GC], γ (+3:
// 16-byte blocks). gdn.py chunk_floats mirrors it.
#define OFF_U (GC * DK)
#define OFF_QG (OFF_U + GC * DV)
#define OFF_KT (OFF_QG + GC * DK)
#define OFF_P (OFF_KT + GC * DK)
#define OFF_GAMMA (OFF_P + GC * GC)
#define CHUNK_FLOATS (OFF_GAMMA + 4)

static_assert(DK % 4 == 0 && DK <= 128 && DV % DVS == 0 && (DVS == 8 || DVS == 16 || DVS == 32),
              "gdn_chunk.cu: DK % 4 == 0, DK <= 128, DV % DVS == 0, DVS in {8, 16, 32}");
static_assert(DK + DV <= PREP_THREADS && NV % NK == 0, "gdn_chunk.cu: shape");
static_assert((SPR == 2 || SPR == 4) && DVS % SPR == 0, "gdn_chunk_scan: SPR in {2, 4}");

typedef __nv_bfloat16 bf16;
#if PARAM_BF16
typedef bf16 param_t;
#else
typedef float param_t;
#endif
#if OUT_BF16
typedef bf16 out_t;
#else
typedef float out_t;
#endif

__device__ __forceinline__ float param(const param_t* p, int h) {
#if PARAM_BF16
  return __bfloat162float(p[h]);
#else
  return p[h];
#endif
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ void store_out(bf16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_out(float* p, float x) { *p = x; }

// Dynamic shared memory of gdn_chunk_prep: kf [GC][DK + 1], qf [GC][DK + 1], A [GC][GC + 4] (16-byte
// rows), l [GC], beta [GC]. gdn.py _prep_smem mirrors it.
#define KF_LD (DK + 1)
#define A_LD (GC + 4)

extern "C" __global__ void __launch_bounds__(PREP_THREADS)
    gdn_chunk_prep(const bf16* __restrict__ mixed, int mixed_stride, const bf16* __restrict__ a, int a_stride,
                   const bf16* __restrict__ b, int b_stride, const param_t* __restrict__ A_log,
                   const param_t* __restrict__ dt_bias, int T, float* __restrict__ ws) {
  extern __shared__ float4 smem4[];
  float* kf = reinterpret_cast<float*>(smem4);
  float* qf = kf + GC * KF_LD;
  float* As = qf + GC * KF_LD;  // 16-byte aligned: 2 * GC * KF_LD is a multiple of 4
  float* l = As + GC * A_LD;
  float* beta = l + GC;
  const int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t0 = n * GC, kh = h / (NV / NK);
  float* out = ws + ((size_t)n * NV + h) * CHUNK_FLOATS;

  // Gates: thread t < GC computes token t0 + t's log decay and beta; then l = inclusive prefix sum.
  if (tid < GC) {
    float g = 0.f, bt = 0.f;
    if (t0 + tid < T) {
      const size_t r = (size_t)(t0 + tid);
      const float x = __bfloat162float(a[r * a_stride + h]) + param(dt_bias, h);
      const float sp = x > 20.f ? x : log1pf(expf(x));
      g = -expf(param(A_log, h)) * sp;
      bt = 1.f / (1.f + expf(-__bfloat162float(b[r * b_stride + h])));
    }
    l[tid] = g;
    beta[tid] = bt;
  }
  // q and k rows, l2-normalised: warp w takes rows w, w + 8, ...; lane i holds columns i, i + 32, ...
  for (int t = warp; t < GC; t += PREP_THREADS / 32) {
    const bool valid = t0 + t < T;
    const bf16* row = mixed + (size_t)(valid ? t0 + t : 0) * mixed_stride;
    float qv[(DK + 31) / 32], kv[(DK + 31) / 32], sq = 0.f, sk = 0.f;
#pragma unroll
    for (int i = 0; i < (DK + 31) / 32; ++i) {
      const int c = lane + 32 * i;
      qv[i] = valid && c < DK ? __bfloat162float(row[kh * DK + c]) : 0.f;
      kv[i] = valid && c < DK ? __bfloat162float(row[NK * DK + kh * DK + c]) : 0.f;
      sq = fmaf(qv[i], qv[i], sq);
      sk = fmaf(kv[i], kv[i], sk);
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, off);
      sk += __shfl_xor_sync(0xffffffffu, sk, off);
    }
    const float rq = rsqrtf(sq + 1e-6f) * (float)(1.0 / sqrt((double)DK)), rk = rsqrtf(sk + 1e-6f);
#pragma unroll
    for (int i = 0; i < (DK + 31) / 32; ++i) {
      const int c = lane + 32 * i;
      if (c < DK) {
        qf[t * KF_LD + c] = qv[i] * rq;
        kf[t * KF_LD + c] = kv[i] * rk;
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    float s = 0.f;
    for (int t = 0; t < GC; ++t) l[t] = s += l[t];
  }
  __syncthreads();

  // P (to the workspace) and A (shared) in 4 x 4 blocks: thread (bt, bj) = (tid / 16, tid % 16) takes rows
  // 4 bt .., columns 4 bj .. of q k^T and k k^T.
  {
    const int bt = tid / 16, bj = tid % 16;
    float dq[4][4] = {}, dk[4][4] = {};
#pragma unroll 4
    for (int c = 0; c < DK; ++c) {
      float qa[4], ka[4], kb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        qa[i] = qf[(4 * bt + i) * KF_LD + c];
        ka[i] = kf[(4 * bt + i) * KF_LD + c];
        kb[i] = kf[(4 * bj + i) * KF_LD + c];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          dq[i][j] = fmaf(qa[i], kb[j], dq[i][j]);
          dk[i][j] = fmaf(ka[i], kb[j], dk[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = 4 * bt + i;
      float p[4], ak[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int jj = 4 * bj + j;
        const float d = jj <= t ? expf(l[t] - l[jj]) : 0.f;
        p[j] = dq[i][j] * d;
        ak[j] = jj < t ? beta[t] * dk[i][j] * d : 0.f;
      }
      *reinterpret_cast<float4*>(out + OFF_P + t * GC + 4 * bj) = make_float4(p[0], p[1], p[2], p[3]);
      *reinterpret_cast<float4*>(As + t * A_LD + 4 * bj) = make_float4(ak[0], ak[1], ak[2], ak[3]);
    }
  }
  // Qg [GC][DK] and K~^T [DK][GC] (to the workspace).
  for (int e = tid; e < GC * DK; e += PREP_THREADS) {
    const int t = e / DK, c = e % DK;
    out[OFF_QG + e] = qf[t * KF_LD + c] * expf(l[t]);
    const int k = e / GC, u = e % GC;
    out[OFF_KT + e] = kf[u * KF_LD + k] * expf(l[GC - 1] - l[u]);
  }
  if (tid == 0) out[OFF_GAMMA] = expf(l[GC - 1]);
  __syncthreads();  // A complete

  // Forward substitution, one column of [β Γ k | β v] per thread, the column in registers:
  // x_t -= sum_{j < t} A_tj x_j, t in order.
  const int c = tid;
  if (c < DK + DV) {
    float x[GC];
#pragma unroll
    for (int t = 0; t < GC; ++t) {
      if (c < DK)
        x[t] = beta[t] * expf(l[t]) * kf[t * KF_LD + c];
      else
        x[t] = t0 + t < T ? beta[t] * __bfloat162float(mixed[(size_t)(t0 + t) * mixed_stride + 2 * NK * DK +
                                                             h * DV + c - DK])
                          : 0.f;
    }
#pragma unroll
    for (int t = 1; t < GC; ++t) {
      const float4* at = reinterpret_cast<const float4*>(As + t * A_LD);
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
      for (int j4 = 0; j4 < (t + 3) / 4; ++j4) {
        const float4 av = at[j4];  // A_tj = 0 for j >= t
        s0 = fmaf(av.x, x[4 * j4], s0);
        if (4 * j4 + 1 < t) s1 = fmaf(av.y, x[4 * j4 + 1], s1);
        if (4 * j4 + 2 < t) s2 = fmaf(av.z, x[4 * j4 + 2], s2);
        if (4 * j4 + 3 < t) s3 = fmaf(av.w, x[4 * j4 + 3], s3);
      }
      x[t] -= (s0 + s1) + (s2 + s3);
    }
    float* dst = c < DK ? out + c : out + OFF_U + (c - DK);
    const int ld = c < DK ? DK : DV;
#pragma unroll
    for (int t = 0; t < GC; ++t) dst[t * ld] = x[t];
  }
}

// One walk over the chunks for the [DK, DVS] state tile of value head h, columns j0 ..: S and the current
// chunk's corrected values Uc in shared memory, the rest streamed from the workspace (L2: the head's DV /
// DVS CTAs are neighbours in the grid and read the same chunk at about the same time).
// Thread tid: row t = tid / SPR of Uc and o and state rows k = t, t + 64, ..., columns c0 = (tid % SPR) * CPT
// .. + CPT.
#define CPT (DVS / SPR)

// x[i] += sum_j row[j] * Uc[j][c0 + i] over the chunk's GC rows j, in j order (row: GC floats, 16-byte
// aligned): P Uc for o and K~^T Uc for S.
__device__ __forceinline__ void add_row_times_uc(const float* row, const float (*Uc)[DVS], int c0,
                                                 float (&x)[CPT]) {
  const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
  for (int j4 = 0; j4 < GC / 4; ++j4) {
    const float4 v = __ldg(r4 + j4);
    const float vj[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int i = 0; i < CPT; ++i) x[i] = fmaf(vj[jj], Uc[4 * j4 + jj][c0 + i], x[i]);
  }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    gdn_chunk_scan(const float* __restrict__ ws, int nchunks, int T, const float* state_in, float* state_out,
                   out_t* __restrict__ o) {
  __shared__ __align__(16) float S[DK][DVS];
  __shared__ __align__(16) float Uc[GC][DVS];
  const int h = blockIdx.y, j0 = blockIdx.x * DVS, tid = threadIdx.x;
  const int t = tid / SPR, c0 = (tid % SPR) * CPT;
  const float* s_in = state_in + (size_t)h * DK * DV + j0;
  for (int e = tid; e < DK * DVS; e += SCAN_THREADS) S[e / DVS][e % DVS] = s_in[(size_t)(e / DVS) * DV + e % DVS];
  __syncthreads();
  for (int n = 0; n < nchunks; ++n) {
    const float* base = ws + ((size_t)n * NV + h) * CHUNK_FLOATS;
    if (n + 1 < nchunks) {  // ask L2 for this thread's lines of the next chunk while this one runs
      const char* nb = reinterpret_cast<const char*>(base + (size_t)NV * CHUNK_FLOATS);
      for (int i = 0; i < DK * 4; i += 128) {
        prefetch_l2(nb + (size_t)t * DK * 4 + i);
        prefetch_l2(nb + (size_t)(OFF_QG + t * DK) * 4 + i);
      }
      prefetch_l2(nb + (size_t)(OFF_P + t * GC) * 4);
      prefetch_l2(nb + (size_t)(OFF_P + t * GC) * 4 + 128);
      prefetch_l2(nb + (size_t)(OFF_U + t * DV + j0) * 4);
      for (int k = t; k < DK; k += GC) {
        prefetch_l2(nb + (size_t)(OFF_KT + k * GC) * 4);
        prefetch_l2(nb + (size_t)(OFF_KT + k * GC) * 4 + 128);
      }
    }
    float uc[CPT], acc[CPT];
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      uc[i] = __ldg(base + OFF_U + t * DV + j0 + c0 + i);
      acc[i] = 0.f;
    }
    const float4* W = reinterpret_cast<const float4*>(base + t * DK);
    const float4* Qg = reinterpret_cast<const float4*>(base + OFF_QG + t * DK);
#pragma unroll 4
    for (int k4 = 0; k4 < DK / 4; ++k4) {
      const float4 w = __ldg(W + k4), q = __ldg(Qg + k4);
      const float wk[4] = {w.x, w.y, w.z, w.w}, qk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const float* srow = &S[4 * k4 + kk][c0];
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
          uc[i] = fmaf(-wk[kk], srow[i], uc[i]);
          acc[i] = fmaf(qk[kk], srow[i], acc[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < CPT; ++i) Uc[t][c0 + i] = uc[i];
    __syncthreads();  // Uc complete; S read for the last time this chunk
    add_row_times_uc(base + OFF_P + t * GC, Uc, c0, acc);  // o = Qg S + P Uc (P_tj = 0 for j > t)
    if (n * GC + t < T) {
#pragma unroll
      for (int i = 0; i < CPT; ++i) store_out(o + ((size_t)(n * GC + t) * NV + h) * DV + j0 + c0 + i, acc[i]);
    }
    // S = γ S + K~^T Uc.
    const float gamma = __ldg(base + OFF_GAMMA);
    for (int k = t; k < DK; k += GC) {
      float x[CPT] = {};
      add_row_times_uc(base + OFF_KT + k * GC, Uc, c0, x);
#pragma unroll
      for (int i = 0; i < CPT; ++i) S[k][c0 + i] = fmaf(gamma, S[k][c0 + i], x[i]);
    }
    __syncthreads();  // S updated, Uc free for the next chunk
  }
  float* s_out = state_out + (size_t)h * DK * DV + j0;
  for (int e = tid; e < DK * DVS; e += SCAN_THREADS) s_out[(size_t)(e / DVS) * DV + e % DVS] = S[e / DVS][e % DVS];
}

// The same walk on tensor cores (DK % 64 == 0: both model-family shapes): gdn_chunk_scan_tc, grid (DV /
// DVS, NV), 128 threads. Per chunk, warp w:
//   1. rows 16w .. of Uc = U - W S and of o = Qg S (mma.sync m16n8k8 tf32, k = DK): A from the workspace,
//      B = S from shared memory; Uc to shared memory.
//   2. o += P Uc over the chunk's rows j <= 16w + 15 (P_tj = 0 for j > t); o stored.
//   3. state rows (DK / 4) w .. of S = γ S + K~^T Uc, S held in the mma accumulators across chunks and
//      copied to shared memory for step 1 of the next chunk.
// Each product runs in TF32_PASSES tf32 passes: 3 splits both operands into a tf32 high part and a tf32
// remainder and adds lo*hi + hi*lo + hi*hi ("3xTF32", about fp32's accuracy); 1 is hi*hi alone (tf32's ~1e-3 bound).
// K order inside a k8 step: in each 16-column block kb of A, lane t's float4 of columns kb + 4t .. + 3
// serves two mma k-steps, logical k t, t + 4 -> columns kb + 4t + 2e, + 1 for step e = 0, 1; B (rows of S
// or Uc) is read in the same order. Sums over k are the mma's, so not the FMA kernel's bits either.
#if DK % 64 == 0
#ifndef TF32_PASSES
#define TF32_PASSES 3
#endif
static_assert(TF32_PASSES == 1 || TF32_PASSES == 3, "gdn_chunk_scan_tc: TF32_PASSES in {1, 3}");
#define TC_THREADS 128
#define NTL (DVS / 8)    // n8 tiles of the CTA's state columns
#define SLD (DVS + 2)    // shared row stride of S and Uc: fragment reads hit 32 distinct banks
#define SMT (DK / 64)    // m16 tiles of state rows per warp
#ifndef P1B
#define P1B (DVS >= 32 ? 2 : 4)  // step 1's k-blocks of 16 per load batch (registers: fewer at wide tiles)
#endif
#define TC_MINB (DVS >= 32 ? 2 : 3)  // CTAs per SM the register allocation must allow
static_assert(DK % (16 * P1B) == 0, "gdn_chunk_scan_tc: DK % (16 P1B) == 0");

struct frag_tf32 {
  unsigned hi, lo;
};
// tf32 parts by truncation (the low 13 mantissa bits cleared: one LOP3; cvt.rna.tf32 is a ~6-instruction
// sequence on sm_90): x = hi + r exactly, lo = r truncated, so |x - hi - lo| <= 2^-20 |x|.
__device__ __forceinline__ frag_tf32 split_tf32(float x) {
  const unsigned hi = __float_as_uint(x) & 0xffffe000u;
#if TF32_PASSES == 3
  return {hi, __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u};
#else
  return {hi, 0u};
#endif
}

// d += A B for one m16n8k8 step: a = A rows (g, g + 8) x logical k (t, t + 4), b = B logical k (t, t + 4).
__device__ __forceinline__ void mma_x(float (&d)[4], const frag_tf32 (&a)[4], const frag_tf32 (&b)[2]) {
#if TF32_PASSES == 3
  mma_tf32(d, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[0].hi, b[1].hi);
  mma_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].lo, b[1].lo);
#endif
  mma_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].hi, b[1].hi);
}

// A fragments of one k8 step e from a lane's float4s of rows g (r0) and g + 8 (r8).
__device__ __forceinline__ void a_frag(frag_tf32 (&a)[4], const float4& r0, const float4& r8, int e) {
  a[0] = split_tf32(e ? r0.z : r0.x);
  a[1] = split_tf32(e ? r8.z : r8.x);
  a[2] = split_tf32(e ? r0.w : r0.y);
  a[3] = split_tf32(e ? r8.w : r8.y);
}

// B fragments of k8 step e of the 16-row block kb for n8 tile nt, from a [.][SLD] shared matrix.
__device__ __forceinline__ void b_frag(frag_tf32 (&b)[2], const float* m, int kb, int e, int nt, int g, int t) {
  b[0] = split_tf32(m[(kb + 4 * t + 2 * e) * SLD + nt * 8 + g]);
  b[1] = split_tf32(m[(kb + 4 * t + 2 * e + 1) * SLD + nt * 8 + g]);
}

__device__ __forceinline__ float4 ldg4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MINB)
    gdn_chunk_scan_tc(const float* __restrict__ ws, int nchunks, int T, const float* state_in, float* state_out,
                      out_t* __restrict__ o) {
  __shared__ __align__(16) float Ss[DK * SLD];
  __shared__ __align__(16) float Us[GC * SLD];
  const int h = blockIdx.y, j0 = blockIdx.x * DVS, tid = threadIdx.x;
  const int lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int r0 = 16 * w;  // this warp's chunk rows (steps 1, 2)

  // S in accumulator layout: sacc[mt][nt][i] holds state row s_row(mt, i), column s_col(nt, i).
  float sacc[SMT][NTL][4];
  auto s_row = [&](int mt, int i) { return (DK / 4) * w + 16 * mt + g + 8 * (i >> 1); };
  auto s_col = [&](int nt, int i) { return nt * 8 + 2 * t + (i & 1); };
  const float* s_in = state_in + (size_t)h * DK * DV + j0;
#pragma unroll
  for (int mt = 0; mt < SMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sacc[mt][nt][i] = s_in[(size_t)s_row(mt, i) * DV + s_col(nt, i)];
        Ss[s_row(mt, i) * SLD + s_col(nt, i)] = sacc[mt][nt][i];
      }
  __syncthreads();

  for (int n = 0; n < nchunks; ++n) {
    const float* base = ws + ((size_t)n * NV + h) * CHUNK_FLOATS;
    if (n + 1 < nchunks) {  // the head's CTAs share out asking L2 for the next chunk's lines
      const char* nb = reinterpret_cast<const char*>(base + (size_t)NV * CHUNK_FLOATS);
      for (int i = tid + blockIdx.x * TC_THREADS; i < CHUNK_FLOATS / 32; i += gridDim.x * TC_THREADS)
        prefetch_l2(nb + (size_t)i * 128);
    }
    // 1. W S and Qg S for rows r0 + {g, g + 8}, the A fragments loaded P1B k-blocks at a time (one L2
    // round trip per batch, not one per k-block).
    float wsacc[NTL][4] = {}, oacc[NTL][4] = {};
    float2 u[NTL][2];
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        u[nt][hr] = __ldg(reinterpret_cast<const float2*>(base + OFF_U + (r0 + g + 8 * hr) * DV + j0 + nt * 8 + 2 * t));
#pragma unroll
    for (int k0 = 0; k0 < DK; k0 += 16 * P1B) {
      float4 w0[P1B], w8[P1B], q0[P1B], q8[P1B];
#pragma unroll
      for (int i = 0; i < P1B; ++i) {
        const int col = k0 + 16 * i + 4 * t;
        w0[i] = ldg4(base + (r0 + g) * DK + col);
        w8[i] = ldg4(base + (r0 + g + 8) * DK + col);
        q0[i] = ldg4(base + OFF_QG + (r0 + g) * DK + col);
        q8[i] = ldg4(base + OFF_QG + (r0 + g + 8) * DK + col);
      }
#pragma unroll
      for (int i = 0; i < P1B; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          frag_tf32 aw[4], aq[4];
          a_frag(aw, w0[i], w8[i], e);
          a_frag(aq, q0[i], q8[i], e);
#pragma unroll
          for (int nt = 0; nt < NTL; ++nt) {
            frag_tf32 b[2];
            b_frag(b, Ss, k0 + 16 * i, e, nt, g, t);
            mma_x(wsacc[nt], aw, b);
            mma_x(oacc[nt], aq, b);
          }
        }
    }
    // Steps 2 and 3's A fragments (P rows r0 + {g, g + 8} up to column r0 + 15, K~^T rows of this warp's
    // state tiles), asked for before the barrier.
    float4 p0[GC / 16], p8[GC / 16], kt0[SMT][GC / 16], kt8[SMT][GC / 16];
#pragma unroll
    for (int i = 0; i < GC / 16; ++i) {
      const int col = 16 * i + 4 * t;
      if (16 * i <= r0) {
        p0[i] = ldg4(base + OFF_P + (r0 + g) * GC + col);
        p8[i] = ldg4(base + OFF_P + (r0 + g + 8) * GC + col);
      }
#pragma unroll
      for (int mt = 0; mt < SMT; ++mt) {
        const int R = (DK / 4) * w + 16 * mt;
        kt0[mt][i] = ldg4(base + OFF_KT + (R + g) * GC + col);
        kt8[mt][i] = ldg4(base + OFF_KT + (R + g + 8) * GC + col);
      }
    }
    const float gamma = __ldg(base + OFF_GAMMA);
    // Uc = U - W S.
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float* dst = Us + (r0 + g + 8 * hr) * SLD + nt * 8 + 2 * t;
        dst[0] = u[nt][hr].x - wsacc[nt][2 * hr];
        dst[1] = u[nt][hr].y - wsacc[nt][2 * hr + 1];
      }
    __syncthreads();  // Uc complete; S read for the last time this chunk

    // 2. o += P Uc (blocks of 16 chunk rows up to this warp's last row), then o stored.
#pragma unroll
    for (int i = 0; i < GC / 16; ++i) {
      if (16 * i > r0) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        frag_tf32 ap[4];
        a_frag(ap, p0[i], p8[i], e);
#pragma unroll
        for (int nt = 0; nt < NTL; ++nt) {
          frag_tf32 b[2];
          b_frag(b, Us, 16 * i, e, nt, g, t);
          mma_x(oacc[nt], ap, b);
        }
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int tok = n * GC + r0 + g + 8 * hr;
      if (tok < T) {
        out_t* dst = o + ((size_t)tok * NV + h) * DV + j0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < NTL; ++nt) {
          store_out(dst + nt * 8, oacc[nt][2 * hr]);
          store_out(dst + nt * 8 + 1, oacc[nt][2 * hr + 1]);
        }
      }
    }

    // 3. S = γ S + K~^T Uc for this warp's state rows.
#pragma unroll
    for (int mt = 0; mt < SMT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) sacc[mt][nt][i] *= gamma;
#pragma unroll
      for (int i = 0; i < GC / 16; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          frag_tf32 ak[4];
          a_frag(ak, kt0[mt][i], kt8[mt][i], e);
#pragma unroll
          for (int nt = 0; nt < NTL; ++nt) {
            frag_tf32 b[2];
            b_frag(b, Us, 16 * i, e, nt, g, t);
            mma_x(sacc[mt][nt], ak, b);
          }
        }
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) Ss[s_row(mt, i) * SLD + s_col(nt, i)] = sacc[mt][nt][i];
    }
    __syncthreads();  // S updated, Uc free for the next chunk
  }
  float* s_out = state_out + (size_t)h * DK * DV + j0;
#pragma unroll
  for (int mt = 0; mt < SMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s_out[(size_t)s_row(mt, i) * DV + s_col(nt, i)] = sacc[mt][nt][i];
}
#endif  // DK % 64 == 0
