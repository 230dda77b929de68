// The M = 1 GEMV's memory traffic without its arithmetic (bench/probe_stream.py): does the order in which
// the packed weights lie in memory change what DRAM delivers? A CTA is one m16 tile of a 64-row group (as
// nvfp4_gemv_rd at M = 1, MTW 1), warp s walks split-K slice s's chunks in order, each lane loading its
// 16 bytes of weights and its 2-byte scale pair per chunk, PF - 1 chunks ahead in a register ring whose
// slots are compile-time indices (the GEMV's ring). WORK rounds of four dependent ALU instructions per chunk
// stand in for the dequant and mma (~70 instructions per chunk in the GEMV). LAYOUT orders the chunks:
//   0  the library's packing: [row group][chunk][tile] (linear.py:pack_fused), scales likewise
//   1  step-major: [chunk][row group][tile], so the CTAs at the same step of their slice read one range
//   2  tile-major: [row group][tile][chunk], each warp's slice one contiguous run
// Nothing is stored unless the folded value takes one it cannot, so every load stays.
//
// lumo:test-defines PF=2 LAYOUT=0 WORK=16
// lumo:test-defines PF=3 LAYOUT=1 WORK=0
// lumo:test-defines PF=1 LAYOUT=2 WORK=4

typedef unsigned int u32;

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Offset, in 16-byte units per lane, of (row group, tile, chunk) of `groups` row groups x `chunks` chunks.
__device__ __forceinline__ size_t chunk_index(int rg, int p, int c, int groups, int chunks) {
#if LAYOUT == 0
  return ((size_t)rg * chunks + c) * 4 + p;
#elif LAYOUT == 1
  return ((size_t)c * groups + rg) * 4 + p;
#else
  return ((size_t)rg * 4 + p) * chunks + c;
#endif
}

extern "C" __global__ void stream_probe(const uint4* __restrict__ w, const unsigned short* __restrict__ sc,
                                        u32* out, int groups, int chunks, int cps) {
  const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
  const int rg = blockIdx.x >> 2, p = blockIdx.x & 3;
  const int c0 = s * cps, n = min(cps, chunks - c0);
  uint4 rw[PF];
  u32 rs[PF];
  auto load = [&](int j, uint4& v, u32& sv) {
    const size_t i = chunk_index(rg, p, c0 + j, groups, chunks) * 32 + lane;
    v = load_stream(w + i);
    sv = __ldg(sc + i);
  };
#pragma unroll
  for (int u = 0; u < PF - 1; ++u)
    if (u < n) load(u, rw[u], rs[u]);
  u32 acc = lane;
  for (int j0 = 0; j0 < n; j0 += PF) {
#pragma unroll
    for (int u = 0; u < PF; ++u) {
      const int j = j0 + u;
      if (j < n) {
        if (j + PF - 1 < n) load(j + PF - 1, rw[(u + PF - 1) % PF], rs[(u + PF - 1) % PF]);
        const uint4 v = rw[u];
        u32 x = v.x ^ rs[u];
#pragma unroll
        for (int r = 0; r < WORK; ++r) x = __funnelshift_l(x, v.y, 3) ^ (v.z + (x & v.w));
        acc += x ^ v.y ^ v.z ^ v.w;
      }
    }
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}
