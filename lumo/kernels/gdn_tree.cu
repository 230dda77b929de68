// Path-parallel Gated DeltaNet tree verifier (DESIGN.md, "The speculative event in detail", step 3).
//
// Grid (P, NV, DV / DVT), one warp per CTA: warp (p, h, tile) loads the COMMITTED state tile
// state[h, :, j0 : j0 + DVT] once, walks path p's nodes root first with gdn_step.cuh's per-token code
// (the code gdn_recurrent runs, with the same DVT, so the same lane layout and reduction trees), keeps the
// tile in registers and writes o[node] only for the nodes the path owns (owner[node] == p). The state in
// memory is never written. Paths sharing a prefix recompute it: that is what keeps every node's o bitwise
// equal to plain decoding of its root-to-node path from the committed state (gdn_recurrent token by token).
// Paths are the fastest grid dimension so the P warps reading the same state tile run close together and
// share it through L2.
//
// Inputs: mixed [R, C] post-conv [q | k | v] bf16 rows of the tree (row stride in elements, 16-byte aligned
// rows), a / b [R, NV] raw bf16 (any row stride), A_log / dt_bias [NV], state [NV, DK, DV] f32 (read only),
// paths [P, path_stride] int32 node ids root first (-1 past the leaf), path_len [P], owner [R] (-1: no
// path writes the row). Output o [R, NV, DV] (f32, or bf16 with OUT_BF16=1); unowned rows untouched.
//
// lumo:test-defines NK=16 NV=48 DK=128 DV=128 DVT=16 PARAM_BF16=0 OUT_BF16=1
// lumo:test-defines NK=2 NV=4 DK=64 DV=64 DVT=16 PARAM_BF16=1 OUT_BF16=0
// lumo:test-defines NK=2 NV=6 DK=32 DV=24 DVT=8 PARAM_BF16=0 OUT_BF16=0

#include <cuda_bf16.h>

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

typedef __nv_bfloat16 bf16;

extern "C" __global__ void __launch_bounds__(32)
    gdn_tree(const bf16* __restrict__ mixed, int mixed_stride, const bf16* __restrict__ a, int a_stride,
             const bf16* __restrict__ b, int b_stride, const gdn_param_t* __restrict__ A_log,
             const gdn_param_t* __restrict__ dt_bias, const float* __restrict__ state, gdn_out_t* __restrict__ o,
             const int* __restrict__ paths, int path_stride, const int* __restrict__ path_len,
             const int* __restrict__ owner) {
  const int p = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * DVT, lane = threadIdx.x;
  const int n = min(path_len[p], path_stride);
  if (n <= 0) return;
  const int* path = paths + (size_t)p * path_stride;
  float4 S[GDN_R];  // [GDN_R rows][4 columns] of the committed state tile, private to this path
  gdn_load_state(state + gdn_state_offset(h, j0, lane), S);
  const float A = gdn_param(A_log, h), dtb = gdn_param(dt_bias, h);

  GdnRaw next;
  size_t u = path[0];
  gdn_fetch(mixed + u * mixed_stride, h, j0, lane, __bfloat162float(a[u * a_stride + h]),
            __bfloat162float(b[u * b_stride + h]), next);
  for (int i = 0; i < n; ++i) {
    const GdnRaw raw = next;
    const size_t node = u;
    if (i + 1 < n) {  // prefetch the next node while this one is computed
      u = path[i + 1];
      gdn_fetch(mixed + u * mixed_stride, h, j0, lane, __bfloat162float(a[u * a_stride + h]),
                __bfloat162float(b[u * b_stride + h]), next);
    }
    GdnToken tok;
    gdn_prepare(raw, A, dtb, tok);
    const float4 y = gdn_step(S, tok);
    if (lane < GDN_CQ && owner[node] == p) gdn_write_o(o + (node * NV + h) * DV + j0 + 4 * lane, y);
  }
}
