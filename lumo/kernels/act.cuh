// The MLP activation's arithmetic, shared by norms.cu (silu_mul) and linear.cu (the gate+up GEMV's fused
// SwiGLU epilogue), so that both give the same bits: act = bf16(bf16(silu(gate)) * up) for bf16-valued
// gate and up, the two roundings of torch's F.silu then torch.mul on bf16 tensors (lumo.model.mlp).
#pragma once
#include <cuda_bf16.h>

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

// gate, up: bf16 values (as floats); the result still needs its final rounding to bf16.
__device__ __forceinline__ float silu_mul1(float gate, float up) { return __fmul_rn(round_bf16(silu(gate)), up); }
