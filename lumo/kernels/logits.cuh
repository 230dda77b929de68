// Logits as the sampler and the drafter's top-k read them (sampling.cu, tree_ops.cu): f32, or bf16 with
// LOGITS_BF16=1 (the lm_head's output, read as its f32 values: the model's bf16 -> f32 cast, without a
// cast launch and with half the reads).
#pragma once

#ifndef LOGITS_BF16
#define LOGITS_BF16 0
#endif

#if LOGITS_BF16
#include <cuda_bf16.h>
typedef __nv_bfloat16 logit_t;
__device__ __forceinline__ float logit_f32(logit_t v) { return __bfloat162float(v); }
#else
typedef float logit_t;
__device__ __forceinline__ float logit_f32(logit_t v) { return v; }
#endif
