// Path-parallel Gated DeltaNet tree verifier with fork leaves (DESIGN.md, "The speculative event in detail",
// step 3; docs/kernels-tree.md).
//
// Grid (P', NV, DV / DVT), one warp per CTA. The walking paths are the root-to-leaf paths of the tree with
// its leaves removed; every leaf is a FORK of its parent. Warp (p, h, tile) loads the COMMITTED state tile
// state[h, :, j0 : j0 + DVT] once and runs row p's items (lumo.engine.tree.gdn_schedule: a walking path,
// or with `max_rows` a walk down part of one and some of its forks) in order
// with gdn_step.cuh's per-token code (the code gdn_recurrent runs, with the same DVT, so the same lane
// layout and reduction trees):
//   - a plain item steps the path's tile S in registers (a node of the path, root first);
//   - a FORK item steps S and then restores it from shared memory (saved before the first fork of a run):
//     S stays the state after the fork's parent, which the path owns and has just stepped, and the fork's
//     o is that of stepping a copy, bit for bit (a register copy took 68 registers more: 8 of these CTAs
//     per SM instead of 12);
//   - a WRITE item writes o[node]. Every real node is written by exactly one item (walking nodes shared
//     by several paths by the first of them, forks by the owner of their parent); padding rows never.
// A node's o is thus gdn_step applied to the state after its own root-to-node path: bitwise what plain
// decoding of that path from the committed state gives (gdn_recurrent token by token). Shared prefixes of
// walking paths are recomputed (the spine + siblings tree has one walking path, so nothing is). The state
// in memory is never written. Paths are the fastest grid dimension so warps reading the same state tile run
// close together and share it through L2.
//
// Inputs: mixed [R, C] post-conv [q | k | v] bf16 rows of the tree (row stride in elements, 16-byte aligned
// rows; only v is read), qk [R, GDN_QK] f32 the rows' normalised q and k (gdn_step.cuh: written by
// conv_gather_qk or gdn_qk below, once per (row, k head) instead of in each of the head's warps: the same
// bits), a / b [R, NV] raw bf16 (any row stride), A_log / dt_bias [NV], state [NV, DK, DV] f32 (read only),
// items [P', item_stride] int32 node id | GDN_FORK | GDN_WRITE (-1 past the end), items_len [P'].
// Output o [R, NV, DV] (f32, or bf16 with OUT_BF16=1); rows no item writes are untouched.
//
// lumo:test-defines NK=16 NV=48 DK=128 DV=128 DVT=16 PARAM_BF16=0 OUT_BF16=1
// lumo:test-defines NK=2 NV=4 DK=64 DV=64 DVT=16 PARAM_BF16=1 OUT_BF16=0
// lumo:test-defines NK=2 NV=6 DK=32 DV=24 DVT=8 PARAM_BF16=0 OUT_BF16=0

#include <cuda_bf16.h>

#include "pdl.cuh"

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
#define DVT 16  // must be gdn_dvt(DK, DV): the decode kernel's value (it fixes the reduction tree)
#endif
#ifndef PARAM_BF16
#define PARAM_BF16 0
#endif
#ifndef OUT_BF16
#define OUT_BF16 1
#endif

#include "gdn_step.cuh"

// Item flags: the values of lumo.engine.tree (GDN_FORK, GDN_WRITE); the low bits are the node id.
#define GDN_FORK (1 << 30)  // step a copy of S (a leaf forked off the path), keep S
#define GDN_WRITE (1 << 29)  // write o[node]
#define GDN_NODE (GDN_WRITE - 1)

typedef __nv_bfloat16 bf16;

// One item on the path's tile S with its fetched operands `raw` and its gates (decay, beta). A fork first
// saves S to `keep` (once per run of forks: `saved`), steps S itself and takes it back: the bits of
// stepping a copy, without a second tile in registers (222 -> 154 registers at the 27B shape in session 15).
__device__ __forceinline__ void gdn_item(float4 (&S)[GDN_R], float4 (*keep)[32], bool& saved, int cur,
                                         const GdnNormed& raw, float decay, float beta, int h, int j0,
                                         int lane, gdn_out_t* __restrict__ o) {
  GdnToken tok;
  gdn_prepare_normed(raw, decay, beta, tok);
  const bool fork = cur & GDN_FORK;  // warp-uniform
  if (fork && !saved) {
#pragma unroll
    for (int m = 0; m < GDN_R; ++m) keep[m][lane] = S[m];
    saved = true;
  }
  const float4 y = gdn_step(S, tok);
  if (fork) {  // back to the state after the fork's parent
#pragma unroll
    for (int m = 0; m < GDN_R; ++m) S[m] = keep[m][lane];
  } else {
    saved = false;
  }
  if (lane < GDN_CQ && (cur & GDN_WRITE))
    gdn_write_o(o + ((size_t)(cur & GDN_NODE) * NV + h) * DV + j0 + 4 * lane, y);
}

extern "C" __global__ void __launch_bounds__(32)
    gdn_tree(const bf16* __restrict__ mixed, int mixed_stride, const float* __restrict__ qk,
             const bf16* __restrict__ a, int a_stride, const bf16* __restrict__ b, int b_stride,
             const gdn_param_t* __restrict__ A_log, const gdn_param_t* __restrict__ dt_bias,
             const float* __restrict__ state, gdn_out_t* __restrict__ o, const int* __restrict__ items,
             int item_stride, const int* __restrict__ items_len) {
  const int p = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * DVT, lane = threadIdx.x;
  // Before the wait: the gate parameters (no kernel writes them) and an L2 request for the state tile.
  const float A = gdn_param(A_log, h), dtb = gdn_param(dt_bias, h);
  gdn_prefetch_state(state + gdn_state_offset(h, j0, lane), lane);
  pdl_begin();
  const int n = min(items_len[p], item_stride);
  if (n <= 0) return;
  const int* item = items + (size_t)p * item_stride;
  float4 S[GDN_R];  // [GDN_R rows][4 columns] of the committed state tile, private to this path
  gdn_load_state(state + gdn_state_offset(h, j0, lane), S);
  __shared__ float4 keep[GDN_R][32];
  bool saved = false;

  // The gates of 32 items at a time, lane l computing item i0 + l's (one MUFU chain per 32 items, off the
  // items' dependent chain; gdn_gate has no cross-lane step, so any lane gives the same bits); an item
  // takes its pair by shuffle. q, k and v are fetched one item ahead into two buffers taken in turn (the
  // loop runs two items per trip, so neither buffer is copied into the other).
  float g_decay = 0.f, g_beta = 0.f;
  auto gates32 = [&](int i0) {
    if (i0 + lane < n) {
      const size_t u = item[i0 + lane] & GDN_NODE;
      gdn_gate(__bfloat162float(a[u * a_stride + h]), __bfloat162float(b[u * b_stride + h]), A, dtb, g_decay,
               g_beta);
    }
  };
  auto fetch = [&](int it, GdnNormed& raw) {
    const size_t u = it & GDN_NODE;
    gdn_fetch_normed(qk + u * GDN_QK, mixed + u * mixed_stride, h, j0, lane, raw);
  };
  GdnNormed even, odd;
  int cur = item[0];
  fetch(cur, even);
  for (int i = 0; i < n; i += 2) {
    if (i % 32 == 0) gates32(i);  // (i is even, so it meets every multiple of 32)
    const int nxt = i + 1 < n ? item[i + 1] : 0;
    if (i + 1 < n) fetch(nxt, odd);
    gdn_item(S, keep, saved, cur, even, __shfl_sync(0xffffffffu, g_decay, i & 31),
             __shfl_sync(0xffffffffu, g_beta, i & 31), h, j0, lane, o);
    if (i + 1 >= n) break;
    cur = i + 2 < n ? item[i + 2] : 0;
    if (i + 2 < n) fetch(cur, even);
    gdn_item(S, keep, saved, nxt, odd, __shfl_sync(0xffffffffu, g_decay, (i + 1) & 31),
             __shfl_sync(0xffffffffu, g_beta, (i + 1) & 31), h, j0, lane, o);
  }
}

// qk [R, GDN_QK] of mixed's R rows, for callers without conv_gather_qk (tests, benchmarks). Grid (R, 2 * NK),
// one warp: head y < NK is q head y, else k head y - NK.
extern "C" __global__ void __launch_bounds__(32)
    gdn_qk(const bf16* __restrict__ mixed, int mixed_stride, float* __restrict__ qk) {
  const int r = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
  pdl_begin();
  __nv_bfloat162 in[GDN_R / 2];
  gdn_load_rows(mixed + (size_t)r * mixed_stride + head * DK + (lane / GDN_CQ) * GDN_R, in);
  gdn_qk_store(in, head < NK, qk + (size_t)r * GDN_QK + head * DK, lane);
}
