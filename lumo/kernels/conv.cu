// GDN causal depthwise conv (kernel KC) + SiLU: prefill, gathered decode (plain / chain / tree), commit.
//
// For channel c and a window of KC pre-conv inputs (oldest first) in_0 .. in_{KC-1} (in_{KC-1} = the row's
// own input):  y = bf16(silu(bf16(sum_j w[c, j] * in_j)))   (fp32 fmaf chain, j = 0 .. KC-1 in order)
// The inner bf16 rounding is lumo.model's: it runs F.conv1d in the model dtype, then silu.
// Every kernel uses the same conv_silu (conv.cuh; also nvfp4_gemv_rd's CONV epilogue, linear.cu), so a row's
// bits depend only on its window: prefill of T tokens, T one-token decodes, the GEMV-fused decode and a
// chain/tree gather of the same windows agree bitwise (batch invariance).
//
// State: [C, KC-1] bf16 per channel, the last KC-1 PRE-conv inputs, oldest first (lumo.model.Cache).
// x: [T, C] bf16 pre-conv inputs with row stride x_rs (a view into the fused projection output is fine).
//
// conv_prefill:  grid (ceil(C / CT), ceil(T / TT)), block CT; thread = one channel over TT tokens. The CTA
//                row of the first token tile also writes the new state (it alone reads the old one).
// conv_gather:   grid (ceil(C / CT), T), block CT; window of row t: pred[t][j] >= 0 is row pred[t][j] of x,
//                pred[t][j] < 0 is state column -1 - pred[t][j]; j = 0 .. KC-2 oldest first, then x[t].
// conv_gather_qk (compiled with the GDN head shape NK NV DK DV DVT): conv_gather in blocks of QT channels,
//                and the blocks of the q / k channels also write the rows' normalised q and k for gdn_tree
//                (gdn_step.cuh's gdn_qk_store on this row's bf16 outputs: the bits gdn_prepare computes).
// conv_state_commit: grid ceil(C / CT), block CT; appends x[rows[0]], x[rows[1]], ... (stops at the first
//                negative entry: a fixed-size, -1-padded rows buffer replays in a CUDA graph) to the state.
// conv_decode:   grid ceil(C / CT), block CT; one new token x[0]: conv_gather of the state's window, then
//                conv_state_commit of row 0, in one launch (the same bits). The plain decode step runs this
//                step in the NVFP4 q/k/v/z GEMV's epilogue (linear.cu CONV) and launches conv_decode only
//                where that kernel does not run (nvfp4_linear(conv=...), GPULinear).
//
// lumo:test-defines KC=4
// lumo:test-defines KC=4 NK=16 NV=48 DK=128 DV=128 DVT=16
// lumo:test-defines KC=4 NK=2 NV=6 DK=32 DV=24 DVT=8
// lumo:test-defines KC=4 NK=3 NV=9 DK=96 DV=48 DVT=16 QT=192
// lumo:test-defines KC=3 NK=1 NV=2 DK=256 DV=64 DVT=16

#include <cuda_bf16.h>

#include "conv.cuh"
#include "pdl.cuh"

#ifndef KC
#define KC 4  // conv kernel size K
#endif
#define CT 128  // channels (threads) per CTA
#define TT 64   // conv_prefill: tokens per thread

static_assert(KC >= 2 && TT >= KC - 1, "conv_prefill's first token tile must cover the state");

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float ldf(const bf16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ void load_w(const bf16* __restrict__ w, int c, float (&wv)[KC]) {
#pragma unroll
  for (int j = 0; j < KC; ++j) wv[j] = ldf(w + (size_t)c * KC + j);
}

// Row t's output for channel c over its window through `pred` (conv_gather's rule), rounded to bf16.
__device__ __forceinline__ bf16 gathered_conv(const bf16* __restrict__ x, long long x_rs,
                                              const bf16* __restrict__ state, const int* __restrict__ pred, int t,
                                              int c, const float (&wv)[KC]) {
  float win[KC - 1];
#pragma unroll
  for (int j = 0; j < KC - 1; ++j) {
    const int p = pred[t * (KC - 1) + j];
    win[j] = p >= 0 ? ldf(x + p * x_rs + c) : ldf(state + (size_t)c * (KC - 1) + (-1 - p));
  }
  return __float2bfloat16_rn(conv_silu<KC>(win, ldf(x + t * x_rs + c), wv));
}

extern "C" __global__ void __launch_bounds__(CT)
    conv_prefill(const bf16* __restrict__ x, long long x_rs, const bf16* __restrict__ w, bf16* __restrict__ state,
                 bf16* __restrict__ y, int T, int C) {
  const int c = blockIdx.x * CT + threadIdx.x;
  float wv[KC], win[KC - 1], old[KC - 1];
  if (c < C) load_w(w, c, wv);  // before the wait: no kernel writes the conv weight
  pdl_begin();
  if (c >= C) return;
  const int t0 = blockIdx.y * TT;
  const int t1 = min(t0 + TT, T);
#pragma unroll
  for (int j = 0; j < KC - 1; ++j) {
    const int src = t0 - (KC - 1) + j;  // token index of window slot j (negative: state column KC-1+src)
    if (src < 0) {
      old[j] = ldf(state + (size_t)c * (KC - 1) + (KC - 1) + src);
      win[j] = old[j];
    } else {
      win[j] = ldf(x + src * x_rs + c);
    }
  }
  for (int t = t0; t < t1; ++t) {
    const float xin = ldf(x + t * x_rs + c);
    y[(size_t)t * C + c] = __float2bfloat16_rn(conv_silu<KC>(win, xin, wv));
#pragma unroll
    for (int j = 0; j < KC - 2; ++j) win[j] = win[j + 1];
    win[KC - 2] = xin;
  }
  if (blockIdx.y == 0) {
    // New state = the last KC-1 inputs of cat(old state, x). Only this tile read the old state (t0 = 0,
    // all of old[] loaded above), so writing it here races with nothing.
#pragma unroll
    for (int j = 0; j < KC - 1; ++j) {
      const int src = T - (KC - 1) + j;
      float val = 0.0f;
      if (src >= 0) {
        val = ldf(x + src * x_rs + c);
      } else {
#pragma unroll
        for (int m = 0; m < KC - 1; ++m) val = m == (KC - 1) + src ? old[m] : val;  // no local-memory index
      }
      state[(size_t)c * (KC - 1) + j] = __float2bfloat16_rn(val);
    }
  }
}

extern "C" __global__ void __launch_bounds__(CT)
    conv_gather(const bf16* __restrict__ x, long long x_rs, const bf16* __restrict__ w,
                const bf16* __restrict__ state, const int* __restrict__ pred, bf16* __restrict__ y, int C) {
  const int c = blockIdx.x * CT + threadIdx.x;
  float wv[KC];
  if (c < C) load_w(w, c, wv);  // before the wait: no kernel writes the conv weight
  pdl_begin();
  if (c >= C) return;
  const int t = blockIdx.y;
  y[(size_t)t * C + c] = gathered_conv(x, x_rs, state, pred, t, c, wv);
}

extern "C" __global__ void __launch_bounds__(CT)
    conv_state_commit(bf16* __restrict__ state, const bf16* __restrict__ x, long long x_rs,
                      const int* __restrict__ rows, int n, int C) {
  pdl_begin();
  const int c = blockIdx.x * CT + threadIdx.x;
  if (c >= C) return;
  bf16 win[KC - 1];
#pragma unroll
  for (int j = 0; j < KC - 1; ++j) win[j] = state[(size_t)c * (KC - 1) + j];
  for (int i = 0; i < n; ++i) {
    const int r = rows[i];
    if (r < 0) break;
#pragma unroll
    for (int j = 0; j < KC - 2; ++j) win[j] = win[j + 1];
    win[KC - 2] = x[r * x_rs + c];
  }
#pragma unroll
  for (int j = 0; j < KC - 1; ++j) state[(size_t)c * (KC - 1) + j] = win[j];
}

extern "C" __global__ void __launch_bounds__(CT)
    conv_decode(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ state,
                bf16* __restrict__ y, int C) {
  const int c = blockIdx.x * CT + threadIdx.x;
  bf16* st = state + (size_t)c * (KC - 1);
  float wv[KC];
  if (c < C) {  // before the wait: the conv weight (no kernel writes it) and an L2 request for the state
    load_w(w, c, wv);
    pdl_prefetch_l2(st);
  }
  pdl_begin();
  if (c >= C) return;
  bf16 keep[KC - 1];
#pragma unroll
  for (int j = 0; j < KC - 1; ++j) keep[j] = st[j];
  conv_decode_channel<KC>(wv, keep, x[c], y + c, st);
}

#ifdef DVT
#include "gdn_step.cuh"

#ifndef QT
#define QT (DK > CT ? DK : CT)  // conv_gather_qk's channels per CTA (conv.py: multiple of 32 and DK, >= CT)
#endif
static_assert(QT % DK == 0 && QT % 32 == 0, "conv_gather_qk blocks must hold whole warps and whole heads");

// qk [T, GDN_QK] f32; C >= GDN_QK (the q / k channels come first). Heads never straddle a block (QT % DK
// == 0), so the block's warps normalise the QT / DK heads in it (those below GDN_QK) in turn.
extern "C" __global__ void __launch_bounds__(QT)
    conv_gather_qk(const bf16* __restrict__ x, long long x_rs, const bf16* __restrict__ w,
                   const bf16* __restrict__ state, const int* __restrict__ pred, bf16* __restrict__ y,
                   float* __restrict__ qk, int C) {
  __shared__ __nv_bfloat162 ys[QT / 2];  // this row's outputs of the block's channels (q / k blocks)
  const int c0 = blockIdx.x * QT, c = c0 + threadIdx.x, t = blockIdx.y;
  float wv[KC];
  if (c < C) load_w(w, c, wv);  // before the wait: no kernel writes the conv weight
  pdl_begin();
  if (c < C) {
    const bf16 out = gathered_conv(x, x_rs, state, pred, t, c, wv);
    y[(size_t)t * C + c] = out;
    reinterpret_cast<bf16*>(ys)[threadIdx.x] = out;
  }
  if (c0 >= GDN_QK) return;  // block-uniform: no q / k head in this block
  __syncthreads();
  const int lane = threadIdx.x & 31;
  for (int hb = threadIdx.x >> 5; hb < QT / DK; hb += QT / 32) {  // warp-uniform
    const int head = c0 / DK + hb;
    if (head >= 2 * NK) break;
    __nv_bfloat162 in[GDN_R / 2];
    const __nv_bfloat162* src = ys + (hb * DK + (lane / GDN_CQ) * GDN_R) / 2;
#pragma unroll
    for (int i = 0; i < GDN_R / 2; ++i) in[i] = src[i];
    gdn_qk_store(in, head < NK, qk + (size_t)t * GDN_QK + head * DK, lane);
  }
}
#endif
