// The GDN causal conv (TAPS taps: conv.cu's KC) + SiLU of one channel, for conv.cu's kernels and
// nvfp4_gemv_rd's fused decode epilogue (linear.cu CONV): every user calls these, so a row's bits depend
// only on its window (see conv.cu).
#pragma once

#include <cuda_bf16.h>

// y = silu(bf16(sum_j w[j] * win_j + w[TAPS-1] * xin)): an fp32 fmaf chain oldest first, lumo.model's inner
// bf16 rounding (F.conv1d in the model dtype), then torch's silu x / (1 + exp(-x)).
template <int TAPS>
__device__ __forceinline__ float conv_silu(const float (&win)[TAPS - 1], float xin, const float (&w)[TAPS]) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < TAPS - 1; ++j) acc = fmaf(w[j], win[j], acc);
  acc = fmaf(w[TAPS - 1], xin, acc);
  const float a = __bfloat162float(__float2bfloat16_rn(acc));
  return __fdiv_rn(a, __fadd_rn(1.0f, expf(-a)));
}

// One channel's decode step (conv_decode; nvfp4_gemv_rd's CONV epilogue): given its conv weights w [TAPS]
// and state window keep [TAPS-1] (the last TAPS-1 pre-conv inputs, oldest first) and the new input xin,
// store y = bf16(conv_silu(...)) and the state shifted by one with xin appended.
template <int TAPS>
__device__ __forceinline__ void conv_decode_channel(const float (&w)[TAPS],
                                                    const __nv_bfloat16 (&keep)[TAPS - 1], __nv_bfloat16 xin,
                                                    __nv_bfloat16* y, __nv_bfloat16* st) {
  float win[TAPS - 1];
#pragma unroll
  for (int j = 0; j < TAPS - 1; ++j) win[j] = __bfloat162float(keep[j]);
  *y = __float2bfloat16_rn(conv_silu<TAPS>(win, __bfloat162float(xin), w));
#pragma unroll
  for (int j = 0; j < TAPS - 2; ++j) st[j] = keep[j + 1];
  st[TAPS - 2] = xin;
}
