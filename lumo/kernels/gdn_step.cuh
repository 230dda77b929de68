// The gated delta rule's per-token step on one warp's [DK, DVT] state tile: shared by every GDN kernel that
// must reproduce plain decoding bit for bit (decode, replay, the path-parallel tree verifier). Include it
// after defining NK, NV, DK, DV, DVT (and PARAM_BF16 if A_log / dt_bias are bf16).
//
// Warp layout (fixed by DK and DVT, never by the number of tokens or rows in a launch):
//   GDN_CQ = DVT / 4 column quads, GDN_RG = 32 / GDN_CQ row groups, GDN_R = DK / GDN_RG rows per lane.
//   lane = rg * GDN_CQ + cq holds S[rg*GDN_R + m][j0 + 4*cq + c] for m < GDN_R, c < 4 (float4 per row) and
//   the normalised q, k values of rows rg*GDN_R .. rg*GDN_R + GDN_R - 1.
//
// Fixed arithmetic (what "the same per-token code" means):
//   - every dk reduction (sum k^2, sum q^2, u = S^T k, o = S^T q) is: a serial fma chain over the lane's
//     rows m = 0 .. GDN_R-1 in order, then a butterfly over row groups with shfl_xor offsets GDN_CQ,
//     2*GDN_CQ, .., 16 in that order. Both partners of a butterfly add the same two values (a + b == b + a
//     exactly), so every lane of a column quad ends with the same bits.
//   - explicit __fmaf_rn / __fmul_rn / __fadd_rn everywhere: no compiler contraction choice can differ
//     between the kernels that inline this code.
//   - transcendental: accurate expf / log1pf / rsqrtf (no fast-math), same call sequence everywhere.
#pragma once
#include <cuda_bf16.h>

#include "pdl.cuh"

#define GDN_CQ (DVT / 4)
#define GDN_RG (32 / GDN_CQ)
#define GDN_R (DK / GDN_RG)
#define GDN_C (2 * NK * DK + NV * DV)  // channels of the post-conv mixed row [q | k | v]

static_assert(DVT % 4 == 0 && 32 % (DVT / 4) == 0, "DVT must be 4, 8, 16 or 32");
static_assert(DV % DVT == 0, "DV must be a multiple of DVT");
static_assert(DK % GDN_RG == 0 && GDN_R % 2 == 0, "DK must be a multiple of 2 * row groups");
static_assert(NV % NK == 0, "NV must be a multiple of NK");

#if PARAM_BF16
typedef __nv_bfloat16 gdn_param_t;
#else
typedef float gdn_param_t;
#endif

// Raw (still bf16) operands of one token for one lane: fetched one token ahead to hide load latency.
struct GdnRaw {
  __nv_bfloat162 q[GDN_R / 2];
  __nv_bfloat162 k[GDN_R / 2];
  __nv_bfloat162 v[2];  // columns j0 + 4*cq .. + 3
  float a, b;           // raw in_proj_a / in_proj_b outputs of this head
};

// Prepared operands: l2-normalised k, q (q also * DK^-0.5), v as f32, decay = exp(g), beta.
struct GdnToken {
  float q[GDN_R];
  float k[GDN_R];
  float4 v;
  float decay, beta;
};

__device__ __forceinline__ float gdn_rg_sum(float x) {
#pragma unroll
  for (int off = GDN_CQ; off < 32; off <<= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ void gdn_load_rows(const __nv_bfloat16* p, __nv_bfloat162 (&out)[GDN_R / 2]) {
#if GDN_R % 8 == 0
  const uint4* p4 = reinterpret_cast<const uint4*>(p);  // 16-byte aligned: launcher checks strides
#pragma unroll
  for (int i = 0; i < GDN_R / 8; ++i) {
    uint4 w = __ldg(p4 + i);
    out[4 * i + 0] = *reinterpret_cast<__nv_bfloat162*>(&w.x);
    out[4 * i + 1] = *reinterpret_cast<__nv_bfloat162*>(&w.y);
    out[4 * i + 2] = *reinterpret_cast<__nv_bfloat162*>(&w.z);
    out[4 * i + 3] = *reinterpret_cast<__nv_bfloat162*>(&w.w);
  }
#else
  const __nv_bfloat162* p2 = reinterpret_cast<const __nv_bfloat162*>(p);
#pragma unroll
  for (int i = 0; i < GDN_R / 2; ++i) out[i] = p2[i];
#endif
}

// row: the token's post-conv mixed row (C bf16); ab: this head's raw a, b already read by the caller.
__device__ __forceinline__ void gdn_fetch(const __nv_bfloat16* row, int h, int j0, int lane, float a, float b,
                                          GdnRaw& raw) {
  const int rg = lane / GDN_CQ, cq = lane % GDN_CQ, kh = h / (NV / NK);
  gdn_load_rows(row + kh * DK + rg * GDN_R, raw.q);
  gdn_load_rows(row + NK * DK + kh * DK + rg * GDN_R, raw.k);
  uint2 w = *reinterpret_cast<const uint2*>(row + 2 * NK * DK + h * DV + j0 + 4 * cq);
  raw.v[0] = *reinterpret_cast<__nv_bfloat162*>(&w.x);
  raw.v[1] = *reinterpret_cast<__nv_bfloat162*>(&w.y);
  raw.a = a;
  raw.b = b;
}

// l2norm(x) = x * rsqrt(sum x^2 + 1e-6), then * scale (DK^-0.5 for q, none for k), in place.
__device__ __forceinline__ void gdn_l2norm(const __nv_bfloat162 (&in)[GDN_R / 2], float (&x)[GDN_R],
                                           bool scale) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < GDN_R / 2; ++i) {
    float2 f = __bfloat1622float2(in[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) ss = __fmaf_rn(x[m], x[m], ss);
  const float r = rsqrtf(__fadd_rn(gdn_rg_sum(ss), 1e-6f));
  const float s = (float)(1.0 / sqrt((double)DK));  // DK^-0.5 rounded once to f32, as torch does
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) x[m] = scale ? __fmul_rn(__fmul_rn(x[m], r), s) : __fmul_rn(x[m], r);
}

// g = -exp(A_log) * softplus(a + dt_bias) (torch softplus: identity above 20); decay = exp(g);
// beta = sigmoid(b) = 1 / (1 + exp(-b)).
__device__ __forceinline__ void gdn_gate(float a, float b, float A_log, float dt_bias, float& decay,
                                         float& beta) {
  const float x = __fadd_rn(a, dt_bias);
  const float sp = x > 20.f ? x : log1pf(expf(x));
  decay = expf(__fmul_rn(-expf(A_log), sp));
  beta = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-b)));
}

__device__ __forceinline__ void gdn_prepare(const GdnRaw& raw, float A_log, float dt_bias, GdnToken& tok) {
  gdn_l2norm(raw.q, tok.q, true);
  gdn_l2norm(raw.k, tok.k, false);
  const float2 v0 = __bfloat1622float2(raw.v[0]), v1 = __bfloat1622float2(raw.v[1]);
  tok.v = make_float4(v0.x, v0.y, v1.x, v1.y);
  gdn_gate(raw.a, raw.b, A_log, dt_bias, tok.decay, tok.beta);
}

// ---- q and k normalised once per (token, k head) instead of in each of the head's NV / NK * DV / DVT warps
// (the tree verifier; docs/kernels-tree.md). The normalised row qk [2 * NK * DK] f32 holds q (times DK^-0.5)
// then k, head by head in dk order. A warp in this file's lane layout writes one head with gdn_l2norm, so
// every value is bitwise the one gdn_prepare computes for that lane.
#define GDN_QK (2 * NK * DK)  // floats per normalised row

// `in`: this lane's GDN_R raw values (rows rg * GDN_R ..) of q head (is_q) or k head; dst: that head's DK
// floats of the normalised row. One lane per row group stores (the group's lanes hold the same values).
__device__ __forceinline__ void gdn_qk_store(const __nv_bfloat162 (&in)[GDN_R / 2], bool is_q, float* dst,
                                             int lane) {
  float x[GDN_R];
  gdn_l2norm(in, x, is_q);
  if (lane % GDN_CQ != 0) return;
  dst += (lane / GDN_CQ) * GDN_R;
#pragma unroll
  for (int m = 0; m < GDN_R; m += 2) *reinterpret_cast<float2*>(dst + m) = make_float2(x[m], x[m + 1]);
}

// Operands of one token for the tree verifier: q, k already normalised (a row of qk), v raw. (Its gates,
// gdn_gate of the token's a and b, come separately: gdn_tree computes 32 tokens' at a time.)
struct GdnNormed {
  float q[GDN_R];
  float k[GDN_R];
  __nv_bfloat162 v[2];
};

// qk_row: the token's normalised row; row: its post-conv mixed row (only v is read).
__device__ __forceinline__ void gdn_fetch_normed(const float* qk_row, const __nv_bfloat16* row, int h, int j0,
                                                 int lane, GdnNormed& raw) {
  const int rg = lane / GDN_CQ, cq = lane % GDN_CQ, kh = h / (NV / NK);
  const float* q = qk_row + kh * DK + rg * GDN_R;
  const float* k = qk_row + NK * DK + kh * DK + rg * GDN_R;
#if GDN_R % 4 == 0
#pragma unroll
  for (int m = 0; m < GDN_R; m += 4) {  // 16-byte aligned: DK % 4 == 0 and the launcher checks qk's base
    const float4 qv = __ldg(reinterpret_cast<const float4*>(q + m));
    const float4 kv = __ldg(reinterpret_cast<const float4*>(k + m));
    raw.q[m] = qv.x, raw.q[m + 1] = qv.y, raw.q[m + 2] = qv.z, raw.q[m + 3] = qv.w;
    raw.k[m] = kv.x, raw.k[m + 1] = kv.y, raw.k[m + 2] = kv.z, raw.k[m + 3] = kv.w;
  }
#else
#pragma unroll
  for (int m = 0; m < GDN_R; m += 2) {  // 8-byte aligned (GDN_R is even)
    const float2 qv = __ldg(reinterpret_cast<const float2*>(q + m));
    const float2 kv = __ldg(reinterpret_cast<const float2*>(k + m));
    raw.q[m] = qv.x, raw.q[m + 1] = qv.y;
    raw.k[m] = kv.x, raw.k[m + 1] = kv.y;
  }
#endif
  uint2 w = *reinterpret_cast<const uint2*>(row + 2 * NK * DK + h * DV + j0 + 4 * cq);
  raw.v[0] = *reinterpret_cast<__nv_bfloat162*>(&w.x);
  raw.v[1] = *reinterpret_cast<__nv_bfloat162*>(&w.y);
}

// gdn_prepare for already normalised q, k and gates already computed (gdn_gate): the same GdnToken bits.
__device__ __forceinline__ void gdn_prepare_normed(const GdnNormed& raw, float decay, float beta,
                                                   GdnToken& tok) {
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) {
    tok.q[m] = raw.q[m];
    tok.k[m] = raw.k[m];
  }
  const float2 v0 = __bfloat1622float2(raw.v[0]), v1 = __bfloat1622float2(raw.v[1]);
  tok.v = make_float4(v0.x, v0.y, v1.x, v1.y);
  tok.decay = decay;
  tok.beta = beta;
}

// One token: S *= decay; u = S^T k; delta = beta (v - u); S += k delta^T; returns o = S^T q (4 columns).
__device__ __forceinline__ float4 gdn_step(float4 (&S)[GDN_R], const GdnToken& t) {
  float4 u = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) {
    S[m].x = __fmul_rn(S[m].x, t.decay);
    S[m].y = __fmul_rn(S[m].y, t.decay);
    S[m].z = __fmul_rn(S[m].z, t.decay);
    S[m].w = __fmul_rn(S[m].w, t.decay);
    u.x = __fmaf_rn(S[m].x, t.k[m], u.x);
    u.y = __fmaf_rn(S[m].y, t.k[m], u.y);
    u.z = __fmaf_rn(S[m].z, t.k[m], u.z);
    u.w = __fmaf_rn(S[m].w, t.k[m], u.w);
  }
  float4 d;
  d.x = __fmul_rn(t.beta, __fsub_rn(t.v.x, gdn_rg_sum(u.x)));
  d.y = __fmul_rn(t.beta, __fsub_rn(t.v.y, gdn_rg_sum(u.y)));
  d.z = __fmul_rn(t.beta, __fsub_rn(t.v.z, gdn_rg_sum(u.z)));
  d.w = __fmul_rn(t.beta, __fsub_rn(t.v.w, gdn_rg_sum(u.w)));
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) {
    S[m].x = __fmaf_rn(t.k[m], d.x, S[m].x);
    S[m].y = __fmaf_rn(t.k[m], d.y, S[m].y);
    S[m].z = __fmaf_rn(t.k[m], d.z, S[m].z);
    S[m].w = __fmaf_rn(t.k[m], d.w, S[m].w);
    o.x = __fmaf_rn(S[m].x, t.q[m], o.x);
    o.y = __fmaf_rn(S[m].y, t.q[m], o.y);
    o.z = __fmaf_rn(S[m].z, t.q[m], o.z);
    o.w = __fmaf_rn(S[m].w, t.q[m], o.w);
  }
  return make_float4(gdn_rg_sum(o.x), gdn_rg_sum(o.y), gdn_rg_sum(o.z), gdn_rg_sum(o.w));
}

// State tile of this lane: rows rg*GDN_R + m, columns j0 + 4*cq .. + 3 of head h ([NV, DK, DV] f32).
__device__ __forceinline__ size_t gdn_state_offset(int h, int j0, int lane) {
  const int rg = lane / GDN_CQ, cq = lane % GDN_CQ;
  return ((size_t)h * DK + rg * GDN_R) * DV + j0 + 4 * cq;
}

__device__ __forceinline__ void gdn_load_state(const float* S0, float4 (&S)[GDN_R]) {
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) S[m] = *reinterpret_cast<const float4*>(S0 + (size_t)m * DV);
}

// An L2 request for the state rows of a lane's row group (before pdl_wait: pdl_prefetch_l2); one lane
// per group asks, for the group's 16 * GDN_CQ bytes of each row (within one line: j0 % DVT == 0).
__device__ __forceinline__ void gdn_prefetch_state(const float* S0, int lane) {
  if (lane % GDN_CQ != 0) return;
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) pdl_prefetch_l2(S0 + (size_t)m * DV);
}

__device__ __forceinline__ void gdn_store_state(float* S1, const float4 (&S)[GDN_R]) {
#pragma unroll
  for (int m = 0; m < GDN_R; ++m) *reinterpret_cast<float4*>(S1 + (size_t)m * DV) = S[m];
}

__device__ __forceinline__ float gdn_param(const gdn_param_t* p, int h) {
#if PARAM_BF16
  return __bfloat162float(p[h]);
#else
  return p[h];
#endif
}

// ---- the o writer shared by the decode and tree kernels: round-to-nearest f32 -> bf16, or f32 as is.
#ifndef OUT_BF16
#define OUT_BF16 1
#endif
__device__ __forceinline__ void gdn_write_o(__nv_bfloat16* o, float4 y) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(y.x, y.y), hi = __floats2bfloat162_rn(y.z, y.w);
  uint2 w;
  w.x = *reinterpret_cast<unsigned*>(&lo);
  w.y = *reinterpret_cast<unsigned*>(&hi);
  *reinterpret_cast<uint2*>(o) = w;
}
__device__ __forceinline__ void gdn_write_o(float* o, float4 y) { *reinterpret_cast<float4*>(o) = y; }

#if OUT_BF16
typedef __nv_bfloat16 gdn_out_t;
#else
typedef float gdn_out_t;
#endif
