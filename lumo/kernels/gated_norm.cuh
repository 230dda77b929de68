// The GDN output norm of one (row, value head) on one warp, shared by norms.cu (gated_rmsnorm) and gdn.cu
// (gdn_recurrent_norm, the decode recurrence with this norm fused) so that both give the same bits.
// Lane L holds values L * E .. L * E + E - 1 (E = DVN / 32) of o' = f32(bf16(o)), z and the norm weight w:
//   y = ((o' * rsqrt(sum(o'^2) / DVN + eps)) * w) * silu(z)   (the caller rounds y to bf16)
// The sum of squares is the lane's fmaf chain in value order, then an xor butterfly 16, 8, .., 1 (every lane
// ends with the same bits); every other product and sum is rounded separately (no contraction).
#pragma once
#include "act.cuh"
#include "vec.cuh"

template <int DVN>
__device__ __forceinline__ void gated_norm_warp(const float (&o)[DVN / 32], const float (&z)[DVN / 32],
                                                const float (&w)[DVN / 32], float eps, float (&y)[DVN / 32]) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < DVN / 32; ++j) ss = fmaf(o[j], o[j], ss);
  ss = warp_sum(ss);
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)DVN), eps));
#pragma unroll
  for (int j = 0; j < DVN / 32; ++j) y[j] = __fmul_rn(__fmul_rn(__fmul_rn(o[j], r), w[j]), silu(z[j]));
}
