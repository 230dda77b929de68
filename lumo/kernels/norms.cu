// Row norms: rmsnorm1p with a fused residual add (layer / final / MTP norms) and the GDN output norm; and
// the MLP activation silu(gate) * up (a row kernel of the same kind, one launch instead of torch's two).
//
// rmsnorm1p_residual: one CTA of NT threads per row of H = HID values.
//   h = bf16(h + delta)   (optional; written back in place: the residual stream)
//   y = bf16((h * rsqrt(sum(h^2) / H + eps)) * (1 + w))
// gated_rmsnorm: one warp per (row, value head) over DV values.
//   y = bf16(((o' * rsqrt(sum(o'^2) / DV + eps)) * w) * silu(z)),  o' = f32(bf16(o))
//   (lumo.model.gdn_mixer rounds o to the model dtype before the norm; so does this kernel.)
//
// Batch invariance: a row's arithmetic (per-thread sequential sums over a fixed set of elements, an xor
// butterfly inside the warp, the warp partials summed in warp order) depends only on HID / DV and the
// CTA shape, which are compile-time constants chosen from H / dv alone; never on T or the row's index.
// Every product / sum is written so nvcc cannot contract it differently from lumo.model (mul then add,
// separately rounded), except the sums of squares which are fmaf chains (their order differs from torch
// anyway).
//
// lumo:test-defines HID=5120 NT=640 DV=128 O_F32=1
// lumo:test-defines HID=192 NT=32 DV=64 O_F32=0
// lumo:test-defines HID=5120 NT=640 DV=128 O_F32=1 LUMO_TRACE=4096 LUMO_TRACE_CAP=16

#include <cuda_bf16.h>

#ifndef HID
#define HID 5120  // H: values per row of rmsnorm1p_residual (multiple of 8)
#endif
#ifndef NT
#define NT 128  // threads per CTA of rmsnorm1p_residual (multiple of 32)
#endif
#ifndef DV
#define DV 128  // dv: values per head of gated_rmsnorm (multiple of 32)
#endif
#ifndef O_F32
#define O_F32 1  // gated_rmsnorm: o is f32 (1) or bf16 (0)
#endif
#define GWARPS 4  // gated_rmsnorm: warps (heads) per CTA

typedef __nv_bfloat16 bf16;

static_assert(HID % 8 == 0, "HID must be a multiple of 8 (16-byte vectors)");
static_assert(NT % 32 == 0 && NT <= 1024, "NT must be a multiple of 32");
static_assert(DV % 32 == 0, "DV must be a multiple of 32");

#include "act.cuh"
#include "gated_norm.cuh"
#include "pdl.cuh"
#include "trace.cuh"
#include "vec.cuh"

template <int N>
__device__ __forceinline__ void ld_f32(const float* __restrict__ p, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      float4 f = reinterpret_cast<const float4*>(p)[i];
      v[4 * i] = f.x;
      v[4 * i + 1] = f.y;
      v[4 * i + 2] = f.z;
      v[4 * i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = p[i];
  }
}

// ------------------------------------------------------------------------------------------------
// rmsnorm1p_residual. grid = T CTAs, block = NT. h [T, HID] bf16 (in/out when delta != null),
// delta [T, HID] bf16 or null, w [HID] bf16, y [T, HID] bf16. All contiguous, 16-byte aligned.
#define CHUNKS (HID / 8)
#define CPT ((CHUNKS + NT - 1) / NT)  // 8-value chunks per thread (chunk i of thread tid: tid + i*NT)

extern "C" __global__ void __launch_bounds__(NT)
    rmsnorm1p_residual(bf16* __restrict__ h, const bf16* __restrict__ delta, const bf16* __restrict__ w,
                       bf16* __restrict__ y, float eps) {
  __shared__ float partial[NT / 32];
  TRACE_DECL(3);  // bench/trace_step.py only (trace.cuh): start, wait, rows loaded and squares summed
  TRACE_AT(0);
  const int tid = threadIdx.x;
  const size_t row = (size_t)blockIdx.x * HID;
  float wv[CPT][8];  // the norm weight (no kernel writes it) and an L2 request for h, before the wait
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    if (tid + i * NT < CHUNKS) {
      ld_bf16<8>(w + 8 * (tid + i * NT), wv[i]);
      pdl_prefetch_l2(h + row + 8 * (tid + i * NT));
    }
  }
  pdl_begin();
  TRACE_AT(1);
  float v[CPT][8];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = tid + i * NT;
    if (c < CHUNKS) {
      ld_bf16<8>(h + row + 8 * c, v[i]);
      if (delta != nullptr) {
        float dl[8];
        ld_bf16<8>(delta + row + 8 * c, dl);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i][j] = round_bf16(__fadd_rn(v[i][j], dl[j]));  // torch bf16 add
        st_bf16<8>(h + row + 8 * c, v[i]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = fmaf(v[i][j], v[i][j], ss);
    }
  }
  ss = warp_sum(ss);
  if ((tid & 31) == 0) partial[tid >> 5] = ss;
  TRACE_AT(2);
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int k = 0; k < NT / 32; ++k) total = __fadd_rn(total, partial[k]);  // warp order: fixed
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(total, (float)HID), eps));
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = tid + i * NT;
    if (c < CHUNKS) {
      float o[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = __fmul_rn(__fmul_rn(v[i][j], r), __fadd_rn(1.0f, wv[i][j]));
      st_bf16<8>(y + row + 8 * c, o);
    }
  }
  TRACE_STORE(3, TRACE_KIND_NORM, w);
}

// ------------------------------------------------------------------------------------------------
// gated_rmsnorm. grid = ceil(T * nv / GWARPS), block = 32 * GWARPS; warp = one (row t, head) of DV values.
// o [T, nv, DV] f32 or bf16 with row stride o_rs (elements); z [T, nv, DV] bf16 with row stride z_rs;
// w [DV] bf16; y [T, nv * DV] bf16 contiguous.
#define EPL (DV / 32)  // values per lane (lane L owns L*EPL .. L*EPL + EPL-1)
#if O_F32
typedef float o_t;
#else
typedef bf16 o_t;
#endif

extern "C" __global__ void __launch_bounds__(32 * GWARPS)
    gated_rmsnorm(const o_t* __restrict__ o, long long o_rs, const bf16* __restrict__ z, long long z_rs,
                  const bf16* __restrict__ w, bf16* __restrict__ y, int T, int nv, float eps) {
  const int lane = threadIdx.x & 31;
  float ov[EPL], zv[EPL], wv[EPL], out[EPL];
  ld_bf16<EPL>(w + lane * EPL, wv);  // the norm weight, before the wait (no kernel writes it)
  pdl_begin_early();  // the out-projection's CTAs prefetch its weights while the GDN kernels run
  const long long item = (long long)blockIdx.x * GWARPS + (threadIdx.x >> 5);
  if (item >= (long long)T * nv) return;
  const int t = (int)(item / nv), hd = (int)(item % nv);
  const int col = hd * DV + lane * EPL;
#if O_F32
  ld_f32<EPL>(o + t * o_rs + col, ov);
#pragma unroll
  for (int j = 0; j < EPL; ++j) ov[j] = round_bf16(ov[j]);  // the model rounds o to bf16 first
#else
  ld_bf16<EPL>(o + t * o_rs + col, ov);
#endif
  ld_bf16<EPL>(z + t * z_rs + col, zv);
  gated_norm_warp<DV>(ov, zv, wv, eps, out);
  st_bf16<EPL>(y + (size_t)t * nv * DV + col, out);
}

// ------------------------------------------------------------------------------------------------
// silu_mul. gu [T, 2I] bf16 = [gate | up] rows, act [T, I] bf16: act = bf16(bf16(silu(gate)) * up), the
// two roundings of torch's F.silu then torch.mul on bf16 tensors. One thread per 8 values (I % 8 == 0).
extern "C" __global__ void silu_mul(const bf16* __restrict__ gu, bf16* __restrict__ act, int T, int I) {
  pdl_begin();
  const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (i >= (long long)T * I) return;
  const long long t = i / I, c = i % I;
  float g[8], u[8], o[8];
  ld_bf16<8>(gu + t * 2 * I + c, g);
  ld_bf16<8>(gu + t * 2 * I + I + c, u);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = silu_mul1(g[j], u[j]);
  st_bf16<8>(act + i, o);
}
