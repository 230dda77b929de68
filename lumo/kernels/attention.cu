// Decode / tree-verify attention: T query rows (1 = plain decode, <= 32 tree rows) against one KV cache slot.
//
// Keys of row t, in logical position order: the committed prefix [0, len) (cache slot p = position p), then
// the tree slots whose bit is set in mask[t], in slot order (parents precede children, so slot order is depth
// order): the k-th set bit j sits at logical position len + k. Row t sees n_t = len + popcount(mask[t]) keys.
//
// Split-K over FIXED chunks of logical positions: chunk c = positions [c*CHUNK, (c+1)*CHUNK), whatever len
// and T are. Inside a chunk, warp `sub` owns positions [c*CHUNK + sub*SUB, +SUB): it computes their scores,
// max, exps, sum and P.V; the NSUB sub-partials are combined in sub order, the chunks by attn_decode_merge
// (or attn_decode_merge_head: the same fold) in a fixed order of chunk indices. Everything a query row
// computes is a function of (its q, its n_t keys in position order) only: T, the row's index, the other rows
// and which CTA, warp or lane serves it never enter its arithmetic (batch invariant), and a tree row equals
// the plain decode of the same token after its ancestors were committed. (An mma's output row i depends on A
// row i and its column j on B column j only: a query row's bits do not depend on where in a tile it sits.)
//
// Work split (attn_decode_chunk): CTA = (kv head, y). y < slots: a slot of the chunks wholly below len, which
// every row sees alike: the CTA reads each K/V row once and serves many rows' query heads from it (tree
// verify reads its prefix once per chunk, not T times). A slot CTA walks chunks z, z + slots, ... for all
// rows, or, where at most half as many chunks as slots lie below len, takes one (chunk, group of query tiles)
// item, so a short prefix still spreads over the slots. y >= slots: row y - slots's tail chunks (those
// holding position len and after: the row's own tree keys). A captured graph replays for any len, the grid
// need not be sized by the cache capacity, and CTAs without work only exit.
//
// Tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate). A warp's SUB = 16 keys are one P.V k-step; query
// rows (head h*G + r%G of row r/G for query row r) go through in m16 tiles:
//   scores  S[row][key] = Q K^T: A = Q (16 query rows), B = K^T (n8 = 8 keys, two tiles), k = head dims,
//           permuted (a dot product may take its terms in any fixed order): k-step s = 2u + e, mma k
//           {2t, 2t+1} / {2t+8, 2t+9} of lane (g, t) are dims 32u + 8t + 4e + {0, 1} / {2, 3}. So lane
//           (g, t) reads 16 contiguous bytes (dims 32u + 8t ..) of key g per two k-steps, the four lanes of a
//           quad read 64 contiguous bytes per load, and Q uses the same map.
//   softmax per query row over the 16 keys in registers: lane (g, t) holds rows g and g + 8's scores of
//           keys 2t, 2t+1, 8+2t, 9+2t; max and sum over the quad by shuffles in a fixed order.
//   output  O^T[dim][row] = V^T P^T: A = V^T (16 dims per m16 tile), B = P^T (k = the 16 keys, n8 = 8
//           query rows). The score accumulators of lane (g, t) are exactly its P^T fragments (keys 2t,
//           2t+1 and 8+2t, 9+2t of rows g and g + 8), so P never leaves registers (rounded to bf16: the P.V
//           operand). m16 tile i = 4w + e, row g / g + 8 is dim 64w + 8g + 2e / + 1: lane (g, t) reads 16
//           contiguous bytes (dims 64w + 8g ..) of keys 2t, 2t+1, 8+2t, 9+2t, eight lanes read a 128-byte
//           line per load, and one byte permute per register pairs two keys' values of a dim.
// A warp loads its keys' K and V rows once per chunk (after an L2 prefetch of them) and keeps them in
// registers for every query tile; the query tiles are staged in shared memory by cp.async, the next one
// during this one; the CTA's next chunk is prefetched into L2 while this one computes.
//
// lumo:test-defines D=256 G=6
// lumo:test-defines D=64 G=2
// lumo:test-defines D=128 G=12

#include <cuda_bf16.h>

#include "mma.cuh"
#include "pdl.cuh"

#ifndef D
#define D 256  // head dim
#endif
#ifndef G
#define G 6  // query heads per kv head (nh / nkv)
#endif
#define CHUNK 128  // positions per split-K partial (part of the arithmetic: fixed)
#define SUB 16     // positions per warp inside a chunk: one P.V k-step (part of the arithmetic: fixed)
#define NSUB (CHUNK / SUB)
#define THREADS (32 * NSUB)
#define KU (D / 32)       // 16-byte K loads per key and lane (two Q.K k-steps each)
#define VW (D / 64)       // 16-byte V loads per key and lane (four P.V m16 tiles each)
#define MERGE_GROUPS 8    // the merge kernels: chunk residues folded in parallel, then in order

static_assert((D == 64 || D == 128 || D == 256) && G >= 1 && G <= 16,
              "attention.cu: d in {64, 128, 256}, 1 <= G <= 16");

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ u32 bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ u32 word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Index of the k-th (from 0) set bit of m, which must have more than k: a binary search on popcounts.
__device__ __forceinline__ int kth_set_bit(u64 m, int k) {
  int pos = 0;
#pragma unroll
  for (int w = 32; w >= 1; w >>= 1) {
    const int c = __popcll(m & ((1ull << w) - 1));
    if (k >= c) {
      k -= c;
      m >>= w;
      pos += w;
    }
  }
  return pos;
}

// Cache slot of logical position p of a row (p < n): the prefix, else its (p - len)-th tree slot.
__device__ __forceinline__ int slot_of(int p, int len, u64 mk) {
  return p < len ? p : len + kth_set_bit(mk, p - len);
}

// Cache slot of the key at warp position `key`: max_len (no load, a zero row) for keys past the warp's
// `cnt`, which are masked out of the softmax. An out-of-range slot (a caller error) is not loaded either:
// no fault, but that key does take weight.
__device__ __forceinline__ int key_slot(int p0, int key, int cnt, int len, u64 mk, int max_len) {
  const int slot = key < cnt ? slot_of(p0 + key, len, mk) : max_len;
  return slot < max_len ? slot : max_len;
}

// 16 bytes of the K or V row in cache slot `slot` (zero for slot max_len), not kept in L1: a CTA reads each
// row once.
__device__ __forceinline__ uint4 load16(const bf16* base, size_t kv_row, int slot, int off, int max_len) {
  uint4 v{};
  if (slot < max_len)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(base + (size_t)slot * kv_row + off));
  return v;
}

// Prefetch the K or V row of logical position p into L2 (when `ok`).
__device__ __forceinline__ void prefetch_row(const bf16* base, size_t kv_row, int p, bool ok, int len, u64 mk,
                                             int max_len) {
  if (!ok) return;
  const int slot = slot_of(p, len, mk);
  if (slot >= max_len) return;
  const char* r = reinterpret_cast<const char*>(base + (size_t)slot * kv_row);
#pragma unroll
  for (int b = 0; b < 2 * D; b += 128) pdl_prefetch_l2(r + b);
}

#define QROWS 8   // query rows per cross-warp combine: one n8 tile of P.V
#define QSTRIDE (D + 8)  // bf16 per staged query row (16 bytes of padding: 4-way, not 8-way, bank sharing)
// Shared memory: the NSUB sub-partials of QROWS query rows, acc [NSUB][QROWS][D] and (m, l)
// [NSUB][QROWS][2] (floats), then two query tiles [2][16][QSTRIDE] (bf16).
#define SMEM_FLOATS (NSUB * QROWS * (D + 2))
#define SMEM_BYTES (4 * SMEM_FLOATS + 2 * 16 * QSTRIDE * 2)

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  const u32 d = (u32)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}

// Query rows qt .. qt + 15 (zero past qhi) into a shared tile, 16 bytes per thread and step; query row r is
// head h * G + r % G of row r / G (the group's G heads of each row in turn).
__device__ __forceinline__ void stage_q_tile(bf16* tile, const bf16* __restrict__ q, int qt, int qhi, int h,
                                             int nh) {
  for (int i = threadIdx.x; i < 16 * (D / 8); i += THREADS) {
    const int r = i / (D / 8), col = 8 * (i % (D / 8));
    const bool ok = qt + r < qhi;
    const int qr = ok ? qt + r : 0;
    cp_async16(tile + r * QSTRIDE + col, q + ((size_t)(qr / G) * nh + h * G + qr % G) * D + col, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// The partials (acc, m, l) of query rows [qlo, qhi) of kv head h over chunks c0, c0 + cstep, ... < cend,
// whose keys are the logical positions < n mapped to cache slots by (len, mk): mk = 0 and n = len for the
// chunks below len (every row sees the same keys there), a row's own mask for its tail chunks. A warp reads
// its 16 keys' K and V rows once per chunk into registers; the query rows go through in m16 tiles staged in
// shared memory (double-buffered: the next tile, of this chunk or the next, loads during this one; a single
// tile stays), and the warps' sub-partials are combined per QROWS rows in shared memory. Called by every
// thread of the CTA.
__device__ __forceinline__ void chunk_partials(int c0, int cstep, int cend, int qlo, int qhi, int n, int len,
                                               u64 mk, const bf16* __restrict__ q, const bf16* kbase,
                                               const bf16* vbase, size_t kv_row, int max_len, int h, int nh,
                                               int nch, float* __restrict__ part_acc,
                                               float* __restrict__ part_ml, float* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float* pacc = smem;                    // [NSUB][QROWS][D]
  float* pml = pacc + NSUB * QROWS * D;  // [NSUB][QROWS][2]
  bf16* qtiles = reinterpret_cast<bf16*>(smem + SMEM_FLOATS);  // [2][16][QSTRIDE]
  const float scale = 1.0f / sqrtf((float)D);
  const bool one_tile = qhi - qlo <= 16;
  if (c0 >= cend) return;
  stage_q_tile(qtiles, q, qlo, qhi, h, nh);
  int it = 0;  // query tiles done: the current one is in buffer it & 1 (0 if there is only one)

  for (int c = c0; c < cend; c += cstep) {
    const int p0 = c * CHUNK + warp * SUB;
    const int cnt = max(0, min(SUB, n - p0));  // keys of this warp (warp-uniform)
    // K and V rows of the warp's keys: K of key 8j + g (the Q.K B operand), V of keys 2t, 2t + 1, 8 + 2t,
    // 9 + 2t (the P.V A operand). ptxas may interleave some of these loads with the first mmas (13.5 does
    // in one of this function's two inlined copies for sm_121a), so the rows are first prefetched into L2
    // (lane: one key's K or V row); the CTA's next chunk below len follows once this chunk's loads are
    // issued.
    prefetch_row(lane < 16 ? kbase : vbase, kv_row, p0 + (lane & 15), (lane & 15) < cnt, len, mk, max_len);
    int ks[2], vs[4];
#pragma unroll
    for (int j = 0; j < 2; ++j) ks[j] = key_slot(p0, 8 * j + g, cnt, len, mk, max_len);
#pragma unroll
    for (int r = 0; r < 4; ++r) vs[r] = key_slot(p0, 2 * t + (r & 1) + 8 * (r >> 1), cnt, len, mk, max_len);
    uint4 kr[2][KU], vr[4][VW];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int u = 0; u < KU; ++u) kr[j][u] = load16(kbase, kv_row, ks[j], 32 * u + 8 * t, max_len);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int w = 0; w < VW; ++w) vr[r][w] = load16(vbase, kv_row, vs[r], 64 * w + 8 * g, max_len);
    const int pn = (c + cstep) * CHUNK + warp * SUB + (lane & 15);
    prefetch_row(lane < 16 ? kbase : vbase, kv_row, pn, c + cstep < cend && pn < len, len, 0, max_len);

    for (int qt = qlo; qt < qhi; qt += 16, ++it) {
      if (!one_tile) {  // the next tile: this chunk's next, else the next chunk's first
        const int nq = qt + 16 < qhi ? qt + 16 : qlo;
        if (qt + 16 < qhi || c + cstep < cend) stage_q_tile(qtiles + ((it + 1) & 1) * 16 * QSTRIDE, q, nq, qhi, h, nh);
      }
      asm volatile("cp.async.commit_group;\n" ::);  // (empty when nothing was staged: uniform group count)
      asm volatile("cp.async.wait_group 1;\n" ::);
      __syncthreads();
      const bf16* qtile = qtiles + (one_tile ? 0 : (it & 1) * 16 * QSTRIDE) + 8 * t;

      // Scores of query rows qt + g (s[j][0, 1]) and qt + g + 8 (s[j][2, 3]) x keys 8j + 2t, 8j + 2t + 1.
      float s[2][4] = {};
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const uint4 qa = *reinterpret_cast<const uint4*>(qtile + g * QSTRIDE + 32 * u);
        const uint4 qb = *reinterpret_cast<const uint4*>(qtile + (g + 8) * QSTRIDE + 32 * u);
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int j = 0; j < 2; ++j)
            mma_bf16(s[j], word(qa, 2 * e), word(qb, 2 * e), word(qa, 2 * e + 1), word(qb, 2 * e + 1),
                     word(kr[j][u], 2 * e), word(kr[j][u], 2 * e + 1));
      }

      // Softmax over the warp's keys per query row (the quad of lanes g holds all 16 scores of its rows).
      float m[2], l[2];
      u32 pb[2][2];  // P^T fragments: rows qt + 8hh + g, keys {2t, 2t+1} / {8+2t, 9+2t}
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = 8 * (i >> 1) + 2 * t + (i & 1);
          v[i] = key < cnt ? s[i >> 1][2 * hh + (i & 1)] * scale : -INFINITY;
        }
        float mx = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = mx == -INFINITY ? 0.0f : expf(v[i] - mx);
        float sum = (v[0] + v[1]) + (v[2] + v[3]);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // x + y == y + x: both lanes get the same bits
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        m[hh] = mx;
        l[hh] = sum;
        pb[hh][0] = bf16x2(v[0], v[1]);
        pb[hh][1] = bf16x2(v[2], v[3]);
      }

#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int rb = qt + 8 * hh;  // this pass: query rows rb .. rb + 7 (uniform)
        if (rb >= qhi) break;
        // P.V: o[i] = O^T of dims (row g: 64w + 8g + 2e, row g + 8: + 1) x query rows rb + 2t, rb + 2t + 1.
        float o[4 * VW][4] = {};
#pragma unroll
        for (int w = 0; w < VW; ++w)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const u32 k0 = word(vr[0][w], e), k1 = word(vr[1][w], e);
            const u32 k8 = word(vr[2][w], e), k9 = word(vr[3][w], e);
            mma_bf16(o[4 * w + e], __byte_perm(k0, k1, 0x5410), __byte_perm(k0, k1, 0x7632),
                     __byte_perm(k8, k9, 0x5410), __byte_perm(k8, k9, 0x7632), pb[hh][0], pb[hh][1]);
          }
        // The warp's sub-partial to shared memory: query row rb + 2t + b, dims 64w + 8g .. + 7.
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          if (rb + 2 * t + b >= qhi) continue;
          float* dst = pacc + (warp * QROWS + 2 * t + b) * D + 8 * g;
#pragma unroll
          for (int w = 0; w < VW; ++w) {
            const float(*ow)[4] = o + 4 * w;
            *reinterpret_cast<float4*>(dst + 64 * w) =
                make_float4(ow[0][b], ow[0][b + 2], ow[1][b], ow[1][b + 2]);
            *reinterpret_cast<float4*>(dst + 64 * w + 4) =
                make_float4(ow[2][b], ow[2][b + 2], ow[3][b], ow[3][b + 2]);
          }
        }
        if (t == 0 && rb + g < qhi) {
          pml[(warp * QROWS + g) * 2] = m[hh];
          pml[(warp * QROWS + g) * 2 + 1] = l[hh];
        }
        __syncthreads();
        // Combine the NSUB sub-partials in sub order (empty sub-chunks have m = -inf and contribute
        // nothing): warp j sums query row rb + j.
        const int j = warp, r = rb + j;
        if (r < qhi) {
          float M = -INFINITY;
#pragma unroll
          for (int sb = 0; sb < NSUB; ++sb) M = fmaxf(M, pml[(sb * QROWS + j) * 2]);
          float f[NSUB], L = 0.0f;
#pragma unroll
          for (int sb = 0; sb < NSUB; ++sb) {
            const float ms = pml[(sb * QROWS + j) * 2];
            f[sb] = ms == -INFINITY ? 0.0f : expf(ms - M);
            L = fmaf(pml[(sb * QROWS + j) * 2 + 1], f[sb], L);
          }
          const size_t prow = ((size_t)(r / G) * nh + h * G + r % G) * nch + c;
#pragma unroll
          for (int k = 4 * lane; k < D; k += 128) {  // four dims per lane: 16-byte shared and global accesses
            float4 A = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int sb = 0; sb < NSUB; ++sb) {
              const float4 a = *reinterpret_cast<const float4*>(pacc + (sb * QROWS + j) * D + k);
              A = make_float4(fmaf(a.x, f[sb], A.x), fmaf(a.y, f[sb], A.y), fmaf(a.z, f[sb], A.z),
                              fmaf(a.w, f[sb], A.w));
            }
            *reinterpret_cast<float4*>(part_acc + prow * D + k) = A;
          }
          if (lane == 0) {
            part_ml[prow * 2] = M;
            part_ml[prow * 2 + 1] = L;
          }
        }
        __syncthreads();  // the shared partials are rewritten by the next pass
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);  // nothing in flight into shared memory at exit
}

// Grid (nkv, slots + T). CTA (h, z < slots): a slot of the chunks wholly below len, which every row sees
// alike: its K/V rows are read once per CTA and serve many rows (a 32-row tree verify would otherwise
// read its prefix 32 times). With at least `slots` such chunks, CTA z walks chunks z, z + slots, ... for
// all T rows. With at most half as many (short prefixes, where a 32-row verify had ~8 busy CTAs per head
// running 24 query passes each), the slots split the rows too: item i = (chunk i % nb, tile group i / nb) of
// groups of whole m16 query tiles, one item per CTA; a (row, chunk) partial is still computed once, by
// the same per-row arithmetic. CTA (h, slots + y): row y's tail chunks, from the one holding position
// len to its last key (at most two: a row has <= 64 tree keys), with the row's own keys. The heavy slot
// CTAs come first in launch order; CTAs without work only exit, so a captured graph replays for any len.
extern "C" __global__ void __launch_bounds__(THREADS)
    attn_decode_chunk(const bf16* __restrict__ q,          // [T, nkv*G, D]
                      const bf16* __restrict__ kc,         // [max_len, nkv, D]
                      const bf16* __restrict__ vc,         // [max_len, nkv, D]
                      const int* __restrict__ length,      // [1] committed positions len
                      const long long* __restrict__ mask,  // [T] tree-slot bitmask per row
                      float* __restrict__ part_acc,        // [T, nkv*G, nch, D]
                      float* __restrict__ part_ml,         // [T, nkv*G, nch, 2]
                      int nkv, int max_len, int nch, int T) {
  extern __shared__ float smem[];  // SMEM_BYTES (82 KB at d = 256: dynamic)
  pdl_begin();
  const int h = blockIdx.x, slots = gridDim.y - T, nh = nkv * G;
  const int len = min(*length, nch * CHUNK);
  const size_t kv_row = (size_t)nkv * D;
  const bf16* kbase = kc + h * D;
  const bf16* vbase = vc + h * D;
  // This CTA's chunks c0, c0 + cstep, ... < cend for query rows [qlo, qhi), keys < n in slots (len, mk).
  int c0, cstep = 1, cend, qlo, qhi, n = len;
  u64 mk = 0;
  if (blockIdx.y >= slots) {  // tail CTA of row y
    const int y = blockIdx.y - slots;
    mk = (u64)mask[y];
    n = min(len + __popcll(mk), nch * CHUNK);  // keys of row y
    c0 = len / CHUNK;
    cend = (n + CHUNK - 1) / CHUNK;
    qlo = y * G;
    qhi = qlo + G;
  } else {
    const int z = blockIdx.y, nb = len / CHUNK, rows = T * G, tiles = (rows + 15) / 16;
    const int groups_max = nb > 0 ? min(tiles, max(1, slots / nb)) : 1;
    if (groups_max == 1) {  // every row, chunks z, z + slots, ...
      c0 = z;
      cstep = slots;
      cend = nb;
      qlo = 0;
      qhi = rows;
    } else {  // item z: chunk z % nb, the z / nb-th group of `per` m16 query tiles
      const int per = (tiles + groups_max - 1) / groups_max;
      if (z >= nb * ((tiles + per - 1) / per)) return;
      c0 = z % nb;
      cend = c0 + 1;
      qlo = z / nb * per * 16;
      qhi = min(rows, qlo + per * 16);
    }
  }
  chunk_partials(c0, cstep, cend, qlo, qhi, n, len, mk, q, kbase, vbase, kv_row, max_len, h, nh, nch, part_acc,
                 part_ml, smem);
}

// out[t, hq] = (sum_c acc_c e^(m_c - M)) / (sum_c l_c e^(m_c - M)) over row t's chunks, times
// sigmoid(gate[t, hq]) when use_gate. A CTA covers PER blocks of 32 dims of one (row, query head): its
// MERGE_GROUPS warps fold the chunks c = group (mod MERGE_GROUPS) in chunk order, then the groups are
// folded in group order: a fixed order for a given key count, whatever PER is. attn_decode_merge (plain
// decode, grid (T * nh, D / 32)): PER = 1, many CTAs stream a long cache's partials. attn_decode_merge_head
// (tree rows, grid (T * nh)): PER = D / 32, a whole head per CTA, so M and L are folded once per head
// instead of once per 32 dims and the T * nh CTAs are few enough for one wave (session 7: 14.3 -> 6.0 us
// per 32-row verify call at 1k).
template <int PER>
__device__ __forceinline__ void merge_body(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                           const int* __restrict__ length, const long long* __restrict__ mask,
                                           const bf16* __restrict__ gate, long long gate_rs, int gate_hs,
                                           bf16* __restrict__ out, int nh, int nch, int use_gate) {
  __shared__ float gm[MERGE_GROUPS][2], ga[MERGE_GROUPS][32 * PER];
  pdl_begin_early();  // the out-projection's CTAs prefetch its weights while the chunk kernel runs
  const int grp = threadIdx.x >> 5, lane = threadIdx.x & 31, k0 = blockIdx.y * 32 * PER;
  const int t = blockIdx.x / nh;
  const int n = *length + __popcll((u64)mask[t]);
  const int nc = min((n + CHUNK - 1) / CHUNK, nch);
  const size_t base = (size_t)blockIdx.x * nch;
  float M = -INFINITY;
  for (int c = grp; c < nc; c += MERGE_GROUPS) M = fmaxf(M, part_ml[(base + c) * 2]);
  float L = 0.0f, A[PER] = {};
#pragma unroll(PER == 1 ? 4 : 2)
  for (int c = grp; c < nc; c += MERGE_GROUPS) {
    const float f = expf(part_ml[(base + c) * 2] - M);
    L = fmaf(part_ml[(base + c) * 2 + 1], f, L);
#pragma unroll
    for (int kb = 0; kb < PER; ++kb) A[kb] = fmaf(part_acc[(base + c) * D + k0 + 32 * kb + lane], f, A[kb]);
  }
  if (lane == 0) {
    gm[grp][0] = M;
    gm[grp][1] = L;
  }
#pragma unroll
  for (int kb = 0; kb < PER; ++kb) ga[grp][32 * kb + lane] = A[kb];
  __syncthreads();
  if (threadIdx.x >= 32 * PER) return;  // the final fold: one thread per dim of the CTA
  M = -INFINITY;
#pragma unroll
  for (int i = 0; i < MERGE_GROUPS; ++i) M = fmaxf(M, gm[i][0]);
  float f[MERGE_GROUPS];
  L = 0.0f;
#pragma unroll
  for (int i = 0; i < MERGE_GROUPS; ++i) {
    f[i] = gm[i][0] == -INFINITY ? 0.0f : expf(gm[i][0] - M);  // groups without chunks: none
    L = fmaf(gm[i][1], f[i], L);
  }
  for (int j = threadIdx.x; j < 32 * PER; j += 32 * MERGE_GROUPS) {  // once: 32 * PER <= D <= 256 threads
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < MERGE_GROUPS; ++i) a = fmaf(ga[i][j], f[i], a);
    float o = a / L;
    const int k = k0 + j;
    if (use_gate) {
      const float gv = __bfloat162float(gate[t * gate_rs + (long long)(blockIdx.x % nh) * gate_hs + k]);
      o = o / (1.0f + expf(-gv));
    }
    out[(size_t)blockIdx.x * D + k] = __float2bfloat16_rn(o);
  }
}

#define MERGE_ARGS                                                                                          \
  const float *__restrict__ part_acc, const float *__restrict__ part_ml, const int *__restrict__ length,    \
      const long long *__restrict__ mask, const bf16 *__restrict__ gate, long long gate_rs, int gate_hs,    \
      bf16 *__restrict__ out, int nh, int nch, int use_gate
// part_acc [T, nh, nch, D], part_ml [T, nh, nch, 2], gate [T, nh, D] with strides (gate_rs, gate_hs, 1),
// out [T, nh, D].
extern "C" __global__ void __launch_bounds__(32 * MERGE_GROUPS) attn_decode_merge(MERGE_ARGS) {
  merge_body<1>(part_acc, part_ml, length, mask, gate, gate_rs, gate_hs, out, nh, nch, use_gate);
}
extern "C" __global__ void __launch_bounds__(32 * MERGE_GROUPS) attn_decode_merge_head(MERGE_ARGS) {
  merge_body<D / 32>(part_acc, part_ml, length, mask, gate, gate_rs, gate_hs, out, nh, nch, use_gate);
}
