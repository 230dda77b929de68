// Gated DeltaNet recurrence over T tokens of one sequence with the state tile on chip (decode: T = 1;
// commit replay and, for now, prefill: T > 1). Per-token arithmetic lives in gdn_step.cuh (shared with the
// tree verifier), so T tokens in one launch give bitwise the same outputs and state as T launches of one.
//
// Grid (NV, DV / DVT), one warp per CTA; the warp owns state[h, :, j0 : j0 + DVT] in registers
// (DK * DVT / 32 floats per lane) for the whole launch: read once, written once.
// Inputs per token t: mixed[t] = post-conv [q (NK*DK) | k (NK*DK) | v (NV*DV)] bf16, a[t, h], b[t, h]
// raw bf16 (in_proj_a / in_proj_b outputs), A_log, dt_bias [NV] (f32, or bf16 with PARAM_BF16=1).
// Output o [T, NV, DV] f32, or bf16 with OUT_BF16=1 (lumo.model.gdn_mixer rounds o to the model dtype).
// state_in / state_out [NV, DK, DV] f32: equal pointers update in place; distinct ones leave state_in
// untouched (verifier scratch, tests).
//
// lumo:test-defines NK=16 NV=48 DK=128 DV=128 DVT=16 PARAM_BF16=0 OUT_BF16=1
// lumo:test-defines NK=2 NV=4 DK=64 DV=64 DVT=16 PARAM_BF16=1 OUT_BF16=0
// lumo:test-defines NK=2 NV=6 DK=32 DV=24 DVT=8 PARAM_BF16=0 OUT_BF16=0
// lumo:test-defines NK=3 NV=9 DK=64 DV=96 DVT=16 PARAM_BF16=1 OUT_BF16=1
// lumo:test-defines NK=16 NV=48 DK=128 DV=128 DVT=16 PARAM_BF16=0 OUT_BF16=1 LUMO_TRACE=4096 LUMO_TRACE_CAP=16

#include <cuda_bf16.h>

#include "pdl.cuh"
#include "trace.cuh"

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
#ifndef DVT
#define DVT 16  // state columns per warp: part of the arithmetic (fixes the reduction tree), see gdn.py
#endif
#ifndef PARAM_BF16
#define PARAM_BF16 0
#endif
#ifndef OUT_BF16
#define OUT_BF16 1
#endif

#include "gdn_step.cuh"

typedef __nv_bfloat16 bf16;

// The b/a projection's split-K partials summed here (ba_splits > 0; decode, T == 1): raw a / b of head h =
// bf16(sum over slices s in order of part[s * part_stride + h]) from pa / pb, splitk_reduce's arithmetic
// (the bf16 GEMV's bits without its reduce launch; `a` / `b` are then not read). Every slice is loaded
// before the first add (a loop of dependent loads took ~3 us per call on the H200). S <= BA_MAX_SPLITS.
#define BA_MAX_SPLITS 16  // lumo.kernels.linear.MAX_SPLITS
__device__ __forceinline__ float ba_sum(const float* __restrict__ part, int stride, int S, int h) {
  float v[BA_MAX_SPLITS];
#pragma unroll
  for (int i = 0; i < BA_MAX_SPLITS; ++i) v[i] = i < S ? part[(size_t)i * stride + h] : 0.0f;
  float s = v[0];
#pragma unroll
  for (int i = 1; i < BA_MAX_SPLITS; ++i)
    if (i < S) s += v[i];
  return __bfloat162float(__float2bfloat16_rn(s));
}

// Strides are in elements (rows of mixed / a / b may be views into wider fused outputs). T >= 1.
// rows (nullable, int [T]): token t reads row rows[t] of mixed / a / b (commit replay of a tree path);
// count (nullable, one int on the device): only the first min(T, *count) tokens run, so a captured graph
// can replay a data-dependent number of accepted tokens. o rows >= that count are not written.
extern "C" __global__ void __launch_bounds__(32)
    gdn_recurrent(const bf16* __restrict__ mixed, int mixed_stride, const bf16* __restrict__ a, int a_stride,
                  const bf16* __restrict__ b, int b_stride, const gdn_param_t* __restrict__ A_log,
                  const gdn_param_t* __restrict__ dt_bias, const float* state_in, float* state_out,
                  gdn_out_t* __restrict__ o, int T, const int* __restrict__ rows, const int* __restrict__ count,
                  const float* __restrict__ pa, const float* __restrict__ pb, int part_stride, int ba_splits) {
  const int h = blockIdx.x, j0 = blockIdx.y * DVT, lane = threadIdx.x;
  const size_t soff = gdn_state_offset(h, j0, lane);
  // Before the wait: the gate parameters (no kernel writes them) and an L2 request for the state tile.
  const float A = gdn_param(A_log, h), dtb = gdn_param(dt_bias, h);
  gdn_prefetch_state(state_in + soff, lane);
  pdl_begin();
  float4 S[GDN_R];  // [GDN_R rows][4 columns] of the state tile
  gdn_load_state(state_in + soff, S);

  if (count != nullptr) T = min(T, max(*count, 0));  // commit replay: accepted count lives on the device
  if (T == 0) {
    if (state_out != state_in) gdn_store_state(state_out + soff, S);
    return;
  }
  GdnRaw next;
  size_t r = rows != nullptr ? rows[0] : 0;
  if (ba_splits > 0)  // T == 1 (the launcher's rule)
    gdn_fetch(mixed, h, j0, lane, ba_sum(pa, part_stride, ba_splits, h), ba_sum(pb, part_stride, ba_splits, h),
              next);
  else
    gdn_fetch(mixed + r * mixed_stride, h, j0, lane, __bfloat162float(a[r * a_stride + h]),
              __bfloat162float(b[r * b_stride + h]), next);
  for (int t = 0; t < T; ++t) {
    const GdnRaw raw = next;
    if (t + 1 < T) {  // prefetch token t+1 while token t is computed
      r = rows != nullptr ? rows[t + 1] : t + 1;
      gdn_fetch(mixed + r * mixed_stride, h, j0, lane, __bfloat162float(a[r * a_stride + h]),
                __bfloat162float(b[r * b_stride + h]), next);
    }
    GdnToken tok;
    gdn_prepare(raw, A, dtb, tok);
    const float4 y = gdn_step(S, tok);
    if (lane < GDN_CQ) gdn_write_o(o + ((size_t)t * NV + h) * DV + j0 + 4 * lane, y);
  }
  gdn_store_state(state_out + soff, S);
}

// ------------------------------------------------------------------------------------------------
// gdn_recurrent_norm: the one-token decode (T = 1) of gdn_recurrent with the GDN output norm fused (norms.cu
// gated_rmsnorm: y = w * rmsnorm(bf16(o)) * silu(z) per value head), one launch instead of two. Grid NV,
// block 32 * DV / DVT: warp w of CTA h runs gdn_recurrent's warp (h, w) unchanged (same tile, same
// arithmetic, the state updated in place), rounds its o columns to bf16 into shared memory, and after one
// barrier warp 0 normalises the head with gated_norm.cuh, the code gated_rmsnorm runs: y and the state are
// bitwise those of gdn_recurrent (bf16 o) + gated_rmsnorm. o itself is not written. z [NV * DV] bf16 (the
// projection's z columns of the one row), norm_w [DV] bf16, y [NV * DV] bf16.
#if DV % 32 == 0 && DV / DVT <= 32
#include "gated_norm.cuh"
#include "vec.cuh"

extern "C" __global__ void __launch_bounds__(32 * (DV / DVT))
    gdn_recurrent_norm(const bf16* __restrict__ mixed, const bf16* __restrict__ a, const bf16* __restrict__ b,
                       const gdn_param_t* __restrict__ A_log, const gdn_param_t* __restrict__ dt_bias,
                       float* state, const bf16* __restrict__ z, const bf16* __restrict__ norm_w,
                       bf16* __restrict__ y, float eps, const float* __restrict__ pa,
                       const float* __restrict__ pb, int part_stride, int ba_splits) {
  constexpr int E = DV / 32;
  __shared__ __align__(16) bf16 o_head[DV];
  TRACE_DECL(4);  // bench/trace_step.py only (trace.cuh): start, wait, operands prepared, state stored
  TRACE_AT(0);
  const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j0 = warp * DVT;
  const size_t soff = gdn_state_offset(h, j0, lane);
  // Before the wait: the gate parameters and norm weight (no kernel writes them), an L2 request for the tile.
  const float A = gdn_param(A_log, h), dtb = gdn_param(dt_bias, h);
  float wv[E], zv[E];
  if (warp == 0) ld_bf16<E>(norm_w + lane * E, wv);
  gdn_prefetch_state(state + soff, lane);
  pdl_begin();
  TRACE_AT(1);
  float4 S[GDN_R];
  gdn_load_state(state + soff, S);
  if (warp == 0) ld_bf16<E>(z + h * DV + lane * E, zv);
  GdnRaw raw;
  if (ba_splits > 0)
    gdn_fetch(mixed, h, j0, lane, ba_sum(pa, part_stride, ba_splits, h), ba_sum(pb, part_stride, ba_splits, h),
              raw);
  else
    gdn_fetch(mixed, h, j0, lane, __bfloat162float(a[h]), __bfloat162float(b[h]), raw);
  GdnToken tok;
  gdn_prepare(raw, A, dtb, tok);
  TRACE_AT(2);
  const float4 o = gdn_step(S, tok);
  if (lane < GDN_CQ) gdn_write_o(o_head + j0 + 4 * lane, o);
  gdn_store_state(state + soff, S);
  TRACE_AT(3);
  __syncthreads();
  if (warp != 0) return;
  float ov[E], out[E];
  ld_bf16<E>(o_head + lane * E, ov);
  gated_norm_warp<DV>(ov, zv, wv, eps, out);
  st_bf16<E>(y + h * DV + lane * E, out);
  TRACE_STORE(4, TRACE_KIND_GDN, state);
}
#endif
