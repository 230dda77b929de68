// Attention-layer input prep: q/k rmsnorm1p, partial RoPE, K/V cache write (one launch per layer).
//
// Inputs of one attention layer for T rows (prefill, decode, or tree-verify rows):
//   qg [T, nh, 2D] bf16 (q_proj output: per head [query D | gate D]), row stride qg_rs
//   k, v [T, nkv, D] bf16 (k_proj / v_proj outputs), row strides k_rs, v_rs (views into a fused output ok)
//   positions [T] int32 (RoPE positions), slots [T] int32 (KV cache rows; a negative slot writes nothing)
// Outputs:
//   q_out [T, nh, D] bf16 = rope(bf16(rmsnorm1p(query, q_norm)))   (the gate is left in place in qg)
//   k_cache[slot] = rope(bf16(rmsnorm1p(k, k_norm))), v_cache[slot] = v; caches [max_len, nkv, D] bf16
//
// RoPE (lumo.model.apply_partial_rope): on dims j < RD, pairs (j, j + RD/2) rotate_half style,
//   out_j = x_j * cos(f_i) + rot_j * sin(f_i), rot_j = -x_{j+RD/2} (j < RD/2) or x_{j-RD/2}, i = j mod RD/2,
//   f_i = float(pos) * inv_freq[i] in fp32, inv_freq [RD/2] f32 given by the launcher (computed once with
//   the model's own torch expression), cosf/sinf (IEEE, no fast-math) each times rope_scale (a yarn
//   scaling's attention factor, 1 otherwise: x * 1 is x, so the unscaled bits are those without it), each
//   product and the sum rounded separately (__fmul_rn / __fadd_rn: no FMA contraction), then bf16. Dims >= RD
//   pass through.
//
// Launch: grid (T, ceil((nh + nkv) / RWARPS)), block 32 * RWARPS; warp = (row t, head j): j < nh a query
// head, else kv head j - nh (k normed + roped, v copied). Lane L owns dims L*EPL .. L*EPL+EPL-1; the RoPE
// partner dims live HL lanes away (shuffle). Batch invariance: a warp's arithmetic depends only on its
// own row's inputs, its position, D and RD.
//
// lumo:test-defines D=256 RD=64
// lumo:test-defines D=64 RD=16

#include <cuda_bf16.h>

#include "pdl.cuh"

#ifndef D
#define D 256  // head dim d (multiple of 32)
#endif
#ifndef RD
#define RD 64  // rotary dims (even, <= D)
#endif
#define RWARPS 4  // warps (heads) per CTA
#define EPL (D / 32)  // dims per lane
#define HALF (RD / 2)
#define HL (HALF / EPL)  // lanes between RoPE partners

static_assert(D % 32 == 0, "D must be a multiple of 32");
static_assert(RD > 0 && RD % 2 == 0 && RD <= D, "RD must be even, > 0 and <= D");
static_assert(HALF % EPL == 0, "RD/2 must be a multiple of D/32 (partners in whole lanes)");

typedef __nv_bfloat16 bf16;

#include "vec.cuh"

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// v <- bf16(rmsnorm1p(v, w)) then RoPE at position pos (see the header), result in v (bf16-exact floats).
// wv: the lane's norm weights; freq: its inv_freq values (lanes < 2 HL).
__device__ __forceinline__ void norm_rope(float (&v)[EPL], const float (&wv)[EPL], float eps, int pos,
                                          const float (&freq)[EPL], float rope_scale, int lane) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < EPL; ++j) ss = fmaf(v[j], v[j], ss);
  ss = warp_sum(ss);
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)D), eps));
#pragma unroll
  for (int j = 0; j < EPL; ++j) v[j] = round_bf16(__fmul_rn(__fmul_rn(v[j], r), __fadd_rn(1.0f, wv[j])));
  {
    // Partner lane: lanes [0, HL) pair with [HL, 2HL); every lane takes part in the shuffle.
    const int src = lane < HL ? lane + HL : (lane < 2 * HL ? lane - HL : lane);
    float p[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) p[j] = __shfl_sync(0xffffffffu, v[j], src);
    if (lane < 2 * HL) {
      const bool first = lane < HL;
      const float fpos = (float)pos;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const float f = __fmul_rn(fpos, freq[j]);
        const float c = __fmul_rn(cosf(f), rope_scale), s = __fmul_rn(sinf(f), rope_scale);
        const float rot = first ? -p[j] : p[j];
        v[j] = round_bf16(__fadd_rn(__fmul_rn(v[j], c), __fmul_rn(rot, s)));
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * RWARPS)
    qk_norm_rope_kv(const bf16* __restrict__ qg, long long qg_rs, const bf16* __restrict__ k, long long k_rs,
                    const bf16* __restrict__ v, long long v_rs, const bf16* __restrict__ q_norm,
                    const bf16* __restrict__ k_norm, const float* __restrict__ inv_freq,
                    const int* __restrict__ positions, const int* __restrict__ slots, bf16* __restrict__ q_out,
                    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int nh, int nkv, float eps,
                    float rope_scale) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x;
  const int j = blockIdx.y * RWARPS + (threadIdx.x >> 5);
  // Before the wait: the warp's norm weights and the lane's RoPE frequencies (no kernel writes them).
  float wv[EPL], freq[EPL];
  if (j < nh + nkv) ld_bf16<EPL>((j < nh ? q_norm : k_norm) + lane * EPL, wv);
#pragma unroll
  for (int e = 0; e < EPL; ++e) freq[e] = lane < 2 * HL ? inv_freq[(lane * EPL + e) % HALF] : 0.0f;
  pdl_begin();
  if (j >= nh + nkv) return;  // whole warp exits together
  const int pos = positions[t];
  float x[EPL];
  if (j < nh) {
    ld_bf16<EPL>(qg + t * qg_rs + (size_t)j * 2 * D + lane * EPL, x);
    norm_rope(x, wv, eps, pos, freq, rope_scale, lane);
    st_bf16<EPL>(q_out + ((size_t)t * nh + j) * D + lane * EPL, x);
    return;
  }
  const int kh = j - nh;
  const int slot = slots[t];
  ld_bf16<EPL>(k + t * k_rs + (size_t)kh * D + lane * EPL, x);
  norm_rope(x, wv, eps, pos, freq, rope_scale, lane);
  if (slot < 0) return;
  const size_t dst = ((size_t)slot * nkv + kh) * D + lane * EPL;
  st_bf16<EPL>(k_cache + dst, x);
  ld_bf16<EPL>(v + t * v_rs + (size_t)kh * D + lane * EPL, x);
  st_bf16<EPL>(v_cache + dst, x);
}
