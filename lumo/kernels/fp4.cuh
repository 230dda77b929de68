// NVFP4 dequantisation by bit placement, shared by the GEMVs (linear.cu) and the tensor-core probes
// (bench/probe_wgmma.cu). The packing (linear.py:pack_nvfp4) puts each code's bits where dequant8 finds
// them; scale2 turns a packed e5m3 scale byte into the bf16x2 multiplier that makes the product exact.
#pragma once

#include <cuda_bf16.h>

typedef unsigned int u32;

__device__ __forceinline__ u32 bmul2(u32 a, u32 b) {
  // Exact: an E2M1 value times an e4m3 scale has <= 6 significant bits.
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<u32*>(&r);
}

// 8 E2M1 codes -> 4 bf16x2 mma registers holding E2M1 * 2^-126 (bit placement only: 9 ALU ops).
__device__ __forceinline__ void dequant8(u32 w, u32& A, u32& B, u32& C, u32& D) {
  const u32 mask = 0x81C081C0u;  // sign 15 / 31, e1 e0 m at 8..6 / 24..22
  A = w & mask;
#if defined(LUMO_PROBE) && LUMO_PROBE == 3
  // The same bits with the shifts as integer products (IMAD on the FMA pipe instead of SHF on the ALU
  // pipe): the masked bits of rotl(w, 4) and rotl(w, 6) never wrap, rotl(w, 10) and rotl(w, 30) are the
  // low | high words of a product.
  B = (w * 16u) & mask;
  C = ((w * 1024u) | __umulhi(w, 1024u)) & mask;
  D = ((w * 64u) & 0x00400040u) | (((w * 0x40000000u) | __umulhi(w, 0x40000000u)) & 0x81808180u);
#else
  B = __funnelshift_l(w, w, 4) & mask;
  C = __funnelshift_l(w, w, 10) & mask;
  D = (__funnelshift_l(w, w, 6) & 0x00400040u) | (__funnelshift_l(w, w, 30) & 0x81808180u);
#endif
}

// e5m3 scale byte (selected by `sel`) broadcast to both halves as bf16x2 of scale * 2^119 (exponent field
// 117 + 119 + e5 <= 254: always finite). Times dequant8's E2M1 * 2^-126 this is E2M1 * scale * 2^-7, exact.
__device__ __forceinline__ u32 scale2(u32 bytes, u32 sel) {
  return __byte_perm(bytes, 0u, sel) * 16u + 0x76007600u;
}
#define DQ_UNSCALE 128.0f  // 2^7 left over by scale2 * dequant8, applied with gs in fp32 (exact)
