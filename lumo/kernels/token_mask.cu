// A structured output's token mask on logits rows (lumo.engine.grammar): every token whose bit is 0 in its
// row's bitmask gets -inf, before the sampler reads the row. A row whose `on` entry is 0 is left alone
// (requests without a grammar, a tree's rows the grammar never reaches, padding), so the launch costs an
// unconstrained step one read of `on` per CTA.
//
// logits [T, V] bf16, mask [T, W] (W = ceil(V / 32); bit j of word w: token 32 w + j allowed), on [T].
// Grid (CTAS, T), THREADS threads: CTA (b, t) walks row t's tokens b * THREADS + i, striding by
// CTAS * THREADS; a warp reads one mask word and writes only its banned tokens.

#include <cuda_bf16.h>

#include "pdl.cuh"

#define THREADS 256

typedef __nv_bfloat16 bf16;

extern "C" __global__ void __launch_bounds__(THREADS)
    apply_token_mask(bf16* logits, const unsigned int* mask, const int* on, int V, int W) {
  pdl_begin();
  const int t = blockIdx.y;
  if (!on[t]) return;
  bf16* row = logits + (long long)t * V;
  const unsigned int* bits = mask + (long long)t * W;
  const bf16 ninf = __ushort_as_bfloat16(0xff80);
  for (int i = blockIdx.x * THREADS + threadIdx.x; i < V; i += gridDim.x * THREADS) {
    if (!((bits[i >> 5] >> (i & 31)) & 1u)) row[i] = ninf;
  }
}
