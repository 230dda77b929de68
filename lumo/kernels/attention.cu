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
// during this one; the CTA's next chunk is prefetched into L2 while this one computes (and, for one query
// tile, attn_decode_chunk_pipe loads its K during this one). Tree rows (T > 1) run attn_tree_chunk instead
// where the device has the shared memory: its slot CTAs that walk the prefix chunk by chunk stage each
// chunk's K and V in shared memory and a warp runs whole query tiles over all sub-chunks
// (tree_prefix_partials), the same operations in the same order, so the same bits, without chunk_partials'
// cross-warp passes.
//
// lumo:test-defines D=256 G=6
// lumo:test-defines D=64 G=2
// lumo:test-defines D=128 G=12
// lumo:test-defines D=256 G=6 TREE_SI=4

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

// Index of query row r's (row r / G, head h * G + r % G) vector among the T x nh query heads: its q row, and
// (times nch, plus the chunk) its partials' row. Query rows of kv head h go through the kernels in this order.
__device__ __forceinline__ size_t head_row(int r, int h, int nh) { return (size_t)(r / G) * nh + h * G + r % G; }

// Query rows qt .. qt + 15 (zero past qhi) into a shared tile, 16 bytes per thread and step; query row r is
// head h * G + r % G of row r / G (the group's G heads of each row in turn).
__device__ __forceinline__ void stage_q_tile(bf16* tile, const bf16* __restrict__ q, int qt, int qhi, int h,
                                             int nh) {
  for (int i = threadIdx.x; i < 16 * (D / 8); i += THREADS) {
    const int r = i / (D / 8), col = 8 * (i % (D / 8));
    const bool ok = qt + r < qhi;
    const int qr = ok ? qt + r : 0;
    cp_async16(tile + r * QSTRIDE + col, q + head_row(qr, h, nh) * D + col, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Softmax of one sub-chunk's scores s (chunk_partials' mma layout) per query row: the max m, the sum l of
// e^(s * scale - m) and the weights as P^T fragments pb[hh] (rows 8hh + g, keys {2t, 2t+1} / {8+2t, 9+2t};
// keys >= cnt weigh nothing). The quad of lanes g holds all 16 scores of its rows. Shared by both chunk
// paths, with every multiply and add rounded on its own (__fmul_rn / __fadd_rn: no contraction into an
// FMA that one inlined copy might get and the other not), so a row's bits do not depend on the path. FULL
// (tree_prefix_partials: every key of the sub-chunk is there, cnt = SUB, so m is finite): the exps without
// their branch for an empty row (session 31: 10% of attn_tree_chunk's instructions), the same values.
template <bool FULL = false>
__device__ __forceinline__ void sub_softmax(const float (&s)[2][4], int cnt, int t, float scale, float (&m)[2],
                                            float (&l)[2], u32 (&pb)[2][2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = 8 * (i >> 1) + 2 * t + (i & 1);
      v[i] = key < cnt ? __fmul_rn(s[i >> 1][2 * hh + (i & 1)], scale) : -INFINITY;
    }
    float mx = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = !FULL && mx == -INFINITY ? 0.0f : expf(__fsub_rn(v[i], mx));
    float sum = __fadd_rn(__fadd_rn(v[0], v[1]), __fadd_rn(v[2], v[3]));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));  // x + y == y + x: both lanes get the same bits
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
    m[hh] = mx;
    l[hh] = sum;
    pb[hh][0] = bf16x2(v[0], v[1]);
    pb[hh][1] = bf16x2(v[2], v[3]);
  }
}

// The fold of a row's NSUB sub-partials in sub order: M = their max, f[sb] = e^(m_sb - M) (0 for an empty
// sub-chunk, m = -inf), L = sum of l_sb f[sb]; the accumulators then take acc = fma(acc_sb, f[sb], acc) from
// zero in sub order. Shared by both chunk paths (see sub_softmax; FULL: no sub-chunk is empty).
template <bool FULL = false>
__device__ __forceinline__ void sub_weights(const float (&ms)[NSUB], const float (&ls)[NSUB], float (&f)[NSUB],
                                            float& M, float& L) {
  M = -INFINITY;
#pragma unroll
  for (int sb = 0; sb < NSUB; ++sb) M = fmaxf(M, ms[sb]);
  L = 0.0f;
#pragma unroll
  for (int sb = 0; sb < NSUB; ++sb) {
    f[sb] = !FULL && ms[sb] == -INFINITY ? 0.0f : expf(__fsub_rn(ms[sb], M));
    L = fmaf(ls[sb], f[sb], L);
  }
}

// The K or V rows of the warp's keys p0 .. p0 + cnt - 1 into registers, as chunk_partials loads a chunk's
// rows: K of key 8j + g (the Q.K B operand), V of keys 2t, 2t + 1, 8 + 2t, 9 + 2t (the P.V A operand).
__device__ __forceinline__ void load_k(uint4 (&kr)[2][KU], const bf16* kbase, size_t kv_row, int p0, int cnt,
                                       int len, u64 mk, int max_len) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int slot = key_slot(p0, 8 * j + g, cnt, len, mk, max_len);
#pragma unroll
    for (int u = 0; u < KU; ++u) kr[j][u] = load16(kbase, kv_row, slot, 32 * u + 8 * t, max_len);
  }
}
__device__ __forceinline__ void load_v(uint4 (&vr)[4][VW], const bf16* vbase, size_t kv_row, int p0, int cnt,
                                       int len, u64 mk, int max_len) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int slot = key_slot(p0, 2 * t + (r & 1) + 8 * (r >> 1), cnt, len, mk, max_len);
#pragma unroll
    for (int w = 0; w < VW; ++w) vr[r][w] = load16(vbase, kv_row, slot, 64 * w + 8 * g, max_len);
  }
}

// The partials (acc, m, l) of query rows [qlo, qhi) of kv head h over chunks c0, c0 + cstep, ... < cend,
// whose keys are the logical positions < n mapped to cache slots by (len, mk): mk = 0 and n = len for the
// chunks below len (every row sees the same keys there), a row's own mask for its tail chunks. A warp reads
// its 16 keys' K and V rows once per chunk into registers; the query rows go through in m16 tiles staged in
// shared memory (double-buffered: the next tile, of this chunk or the next, loads during this one; a single
// tile stays), and the warps' sub-partials are combined per QROWS rows in shared memory. Called by every
// thread of the CTA.
template <bool PIPE>
__device__ __forceinline__ void chunk_partials(int c0, int cstep, int cend, int qlo, int qhi, int n, int len,
                                               u64 mk, const bf16* __restrict__ q, const bf16* kbase,
                                               const bf16* vbase, size_t kv_row, int max_len, int h, int nh,
                                               int nch, float* __restrict__ part_acc,
                                               float* __restrict__ part_ml, float* smem, bool walk) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float* pacc = smem;                    // [NSUB][QROWS][D]
  float* pml = pacc + NSUB * QROWS * D;  // [NSUB][QROWS][2]
  bf16* qtiles = reinterpret_cast<bf16*>(smem + SMEM_FLOATS);  // [2][16][QSTRIDE]
  const float scale = 1.0f / sqrtf((float)D);
  const bool one_tile = qhi - qlo <= 16;
  // PIPE (attn_decode_chunk_pipe's walking slot CTAs, `walk`): with one query tile, K is dead once the
  // scores are done, so its registers take the CTA's next chunk's K rows right then, and those loads run
  // during this chunk's softmax, P.V and combine instead of stalling the next chunk's first mma (V, needed
  // only after the scores, still loads at the chunk's start: pipelining it too held one more chunk's rows
  // through the P.V, spilled, and lost at long caches). The same loads of the same rows: the same bits.
  const bool piped = PIPE && walk && one_tile;
  if (c0 >= cend) return;
  stage_q_tile(qtiles, q, qlo, qhi, h, nh);
  int it = 0;  // query tiles done: the current one is in buffer it & 1 (0 if there is only one)
  uint4 kr[2][KU], vr[4][VW];

  for (int c = c0; c < cend; c += cstep) {
    const int p0 = c * CHUNK + warp * SUB;
    const int cnt = max(0, min(SUB, n - p0));  // keys of this warp (warp-uniform)
    const int pn0 = (c + cstep) * CHUNK + warp * SUB, cnt_next = max(0, min(SUB, n - pn0));
    const bool pipe_next = piped && c + cstep < cend;  // the next chunk's K loads during this one
    // K and V rows of the warp's keys (load_k, load_v). ptxas may interleave some of these loads with the
    // first mmas (13.5 does in one of this function's two inlined copies for sm_121a), so the rows are
    // first prefetched into L2 (lane: one key's K or V row); the CTA's next chunk below len follows once
    // this chunk's loads are issued.
    if (!piped || c == c0) {  // every slot, then every load (load_k / load_v's order would change the SASS)
      prefetch_row(lane < 16 ? kbase : vbase, kv_row, p0 + (lane & 15), (lane & 15) < cnt, len, mk, max_len);
      int ks[2], vs[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) ks[j] = key_slot(p0, 8 * j + g, cnt, len, mk, max_len);
#pragma unroll
      for (int r = 0; r < 4; ++r) vs[r] = key_slot(p0, 2 * t + (r & 1) + 8 * (r >> 1), cnt, len, mk, max_len);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < KU; ++u) kr[j][u] = load16(kbase, kv_row, ks[j], 32 * u + 8 * t, max_len);
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int w = 0; w < VW; ++w) vr[r][w] = load16(vbase, kv_row, vs[r], 64 * w + 8 * g, max_len);
    } else {  // pipelined: K came during the previous chunk
      load_v(vr, vbase, kv_row, p0, cnt, len, mk, max_len);
    }
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

      if (pipe_next) load_k(kr, kbase, kv_row, pn0, cnt_next, len, 0, max_len);

      // Softmax over the warp's keys per query row (the quad of lanes g holds all 16 scores of its rows).
      float m[2], l[2];
      u32 pb[2][2];  // P^T fragments: rows qt + 8hh + g, keys {2t, 2t+1} / {8+2t, 9+2t}
      sub_softmax(s, cnt, t, scale, m, l, pb);

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
          float ms[NSUB], ls[NSUB], f[NSUB], M, L;
#pragma unroll
          for (int sb = 0; sb < NSUB; ++sb) {
            ms[sb] = pml[(sb * QROWS + j) * 2];
            ls[sb] = pml[(sb * QROWS + j) * 2 + 1];
          }
          sub_weights(ms, ls, f, M, L);
          const size_t prow = head_row(r, h, nh) * nch + c;
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

// attn_tree_chunk's walking slot CTAs (tree rows, chunks wholly below len): a warp owns whole m16 query tiles
// and runs all NSUB sub-chunks of a chunk itself, from the chunk's K and V rows staged once in shared memory
// for every tile, so a (row, chunk) partial needs no combine across warps (chunk_partials spends 2 barriers
// and a round trip of NSUB sub-partials through shared memory per 8 query rows: 24 passes per chunk at 32
// rows x 6 heads). The operations and their order are chunk_partials' for every row: each sub-chunk's scores
// over the same permuted k-steps, sub_softmax, P.V from zero (one mma per 16 dims), the sub-partials folded
// in sub order by sub_weights' factors with fma from zero. So the partials, and a tree row's output, are
// bitwise chunk_partials' (the GPU tests compare tree rows with plain decoding).
//
// Shared memory (TSMEM_BYTES: 164 KB at d = 256, 100 KB at d = 128, 68 KB at d = 64; attention.py runs the
// kernel only where the device grants that much per block, so not at d >= 128 on a GB10's 99 KB): K then V
// of the chunk, [CHUNK][D] bf16 each, in 16-byte units whose index is XOR-swizzled by the row so that the
// mma operand reads of a quarter-warp hit distinct banks: K (key rows 8j + g, units 4u + t) ^ 4 (row & 1),
// V (ldmatrix: 8 key rows of one unit) ^ (row & 7); then each warp's slot (TREE_PSLOT) for a tile's P^T
// fragments and fold factors between its scores and its P.V.
#define TREE_PSLOT (NSUB * 4 * 32 + NSUB * 16)  // per warp, u32: P^T fragments by lane, fold factors by row
#define TSMEM_BYTES (2 * CHUNK * D * 2 + (THREADS / 32) * TREE_PSLOT * 4)
#ifndef TREE_SI
#define TREE_SI 2  // tree_prefix_partials: sub-chunks whose scores are computed together (1, 2, 4 or 8)
#endif

__device__ __forceinline__ int k_unit(int row, int unit) { return row * (D / 8) + (unit ^ ((row & 1) << 2)); }
__device__ __forceinline__ int v_unit(int row, int unit) { return row * (D / 8) + (unit ^ (row & 7)); }

// Four 8x8 bf16 matrices from shared memory, transposed (ldmatrix .trans): lane l gives the address of row l
// & 7 of matrix l / 8; register j of lane (g, t) gets elements (2t, g) and (2t + 1, g) of matrix j.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void tree_prefix_partials(int c0, int cstep, int cend, int qlo, int qhi, int len,
                                                     const bf16* __restrict__ q, const bf16* kbase,
                                                     const bf16* vbase, size_t kv_row, int max_len, int h,
                                                     int nh, int nch, float* __restrict__ part_acc,
                                                     float* __restrict__ part_ml, uint4* smem) {
  constexpr int UNITS = D / 8;  // 16-byte units per K or V row
  constexpr int NWARP = THREADS / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint4* ks = smem;
  uint4* vs = smem + CHUNK * UNITS;
  const float scale = 1.0f / sqrtf((float)D);
  const int tiles = (qhi - qlo + 15) / 16;

  // Per tile, between its scores and its P.V: the P^T fragments (by lane) and the fold factors (by row) in
  // this warp's slot of shared memory, the rows' (M, L) in registers (rows g / g + 8).
  u32* pw = reinterpret_cast<u32*>(smem + 2 * CHUNK * UNITS) + warp * TREE_PSLOT;  // [NSUB][hh][2][32 lanes]
  float* fw = reinterpret_cast<float*>(pw + NSUB * 4 * 32);                        // [NSUB][16 rows]
  float M[2], L[2];
  auto scores = [&](int qt) {
    uint4 qa[KU], qb[KU];  // query rows qt + g / qt + g + 8, dims 32u + 8t .. + 7 (zero past qhi)
    const int ra = qt + g, rb = qt + g + 8;
    const bf16* qpa = q + head_row(ra, h, nh) * D + 8 * t;
    const bf16* qpb = q + head_row(rb, h, nh) * D + 8 * t;
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      qa[u] = ra < qhi ? __ldg(reinterpret_cast<const uint4*>(qpa + 32 * u)) : make_uint4(0, 0, 0, 0);
      qb[u] = rb < qhi ? __ldg(reinterpret_cast<const uint4*>(qpb + 32 * u)) : make_uint4(0, 0, 0, 0);
    }
    __syncwarp();  // the previous tile's P.V has read this warp's slot
    float ms[2][NSUB], ls[2][NSUB];
    // TREE_SI sub-chunks at a time: 2 TREE_SI independent accumulation chains of KU * 2 mmas each.
#pragma unroll
    for (int s0 = 0; s0 < NSUB; s0 += TREE_SI) {
      float s[TREE_SI][2][4] = {};
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        uint4 kf[TREE_SI][2];  // K of key rows 8j + g of each sub-chunk, dims 32u + 8t .. + 7
#pragma unroll
        for (int i = 0; i < TREE_SI; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) kf[i][j] = ks[k_unit((s0 + i) * SUB + 8 * j + g, 4 * u + t)];
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int i = 0; i < TREE_SI; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
              mma_bf16(s[i][j], word(qa[u], 2 * e), word(qb[u], 2 * e), word(qa[u], 2 * e + 1),
                       word(qb[u], 2 * e + 1), word(kf[i][j], 2 * e), word(kf[i][j], 2 * e + 1));
      }
#pragma unroll
      for (int i = 0; i < TREE_SI; ++i) {
        float m[2], l[2];
        u32 pb[2][2];
        sub_softmax<true>(s[i], SUB, t, scale, m, l, pb);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          ms[hh][s0 + i] = m[hh], ls[hh][s0 + i] = l[hh];
          pw[((s0 + i) * 4 + 2 * hh) * 32 + lane] = pb[hh][0];
          pw[((s0 + i) * 4 + 2 * hh + 1) * 32 + lane] = pb[hh][1];
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float f[NSUB];
      sub_weights<true>(ms[hh], ls[hh], f, M[hh], L[hh]);
      if (t == 0)
#pragma unroll
        for (int sb = 0; sb < NSUB; ++sb) fw[sb * 16 + 8 * hh + g] = f[sb];
    }
    __syncwarp();  // the slot is written
  };
  // P.V and the fold for the rows of n8 tile hh (rows qt + 8hh ..) of the tile, then their partials. A sub-
  // chunk's V^T fragments come from shared memory by ldmatrix.trans, one x4 per m16 tile of 16 dims: m16 tile
  // i, row g / g + 8 = dim 16i + g / 16i + 8 + g (which dims an mma row holds does not change its bits: an
  // output row depends on its A row only). Lane l addresses row l & 7 of matrix l / 8: keys (l & 7) +
  // 8 (l / 16) of the sub-chunk, unit 2i + (l / 8) % 2; its four possible swizzled units (i mod 4) are
  // precomputed, the rest is an immediate offset.
  const u32 vs_lane = (u32)__cvta_generic_to_shared(vs) +
                      16 * (((lane & 7) + 8 * (lane >> 4)) * UNITS);  // the lane's key row of sub-chunk 0
  u32 vunit[4];
#pragma unroll
  for (int x = 0; x < 4; ++x) vunit[x] = 16 * ((2 * x) ^ ((lane & 7) ^ ((lane >> 3) & 1)));
  auto values = [&](int qt, int c) {
#pragma unroll 1
    for (int hh = 0; hh < 2; ++hh) {
      const int rb = qt + 8 * hh;  // rows rb .. rb + 7
      if (rb >= qhi) break;        // warp-uniform
      float acc[D / 16][4] = {};
#pragma unroll 1
      for (int sb = 0; sb < NSUB; ++sb) {
        const float f0 = fw[sb * 16 + 8 * hh + 2 * t], f1 = fw[sb * 16 + 8 * hh + 2 * t + 1];
        const u32 p0 = pw[(sb * 4 + 2 * hh) * 32 + lane], p1 = pw[(sb * 4 + 2 * hh + 1) * 32 + lane];
        const u32 vrow = vs_lane + sb * SUB * UNITS * 16;
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
          u32 a[4];  // V^T of dims 16i .. + 15 (rows) x the sub-chunk's keys (columns)
          ldmatrix_x4_trans(a, vrow + vunit[i & 3] + 128 * (i >> 2));
          float o[4] = {};
          mma_bf16(o, a[0], a[1], a[2], a[3], p0, p1);
          float* A = acc[i];
          A[0] = fmaf(o[0], f0, A[0]);
          A[1] = fmaf(o[1], f1, A[1]);
          A[2] = fmaf(o[2], f0, A[2]);
          A[3] = fmaf(o[3], f1, A[3]);
        }
      }
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // query row rb + 2t + b, dims 16i + g and 16i + 8 + g
        const int r = rb + 2 * t + b;
        if (r >= qhi) continue;
        float* dst = part_acc + (head_row(r, h, nh) * nch + c) * D + g;  // lanes g: 32 contiguous bytes
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
          dst[16 * i] = acc[i][b];
          dst[16 * i + 8] = acc[i][b + 2];
        }
      }
      if (t == 0 && rb + g < qhi) {
        const int r = rb + g;
        const size_t prow = head_row(r, h, nh) * nch + c;
        part_ml[prow * 2] = hh ? M[1] : M[0];
        part_ml[prow * 2 + 1] = hh ? L[1] : L[0];
      }
    }
  };

  for (int c = c0; c < cend; c += cstep) {
    __syncthreads();  // every warp is done with the previous chunk's K and V
    for (int i = threadIdx.x; i < CHUNK * UNITS; i += THREADS) {  // K, then V: two cp.async groups
      const size_t src = (size_t)(c * CHUNK + i / UNITS) * kv_row + 8 * (i % UNITS);
      cp_async16(ks + k_unit(i / UNITS, i % UNITS), kbase + src, true);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    for (int i = threadIdx.x; i < CHUNK * UNITS; i += THREADS) {
      const size_t src = (size_t)(c * CHUNK + i / UNITS) * kv_row + 8 * (i % UNITS);
      cp_async16(vs + v_unit(i / UNITS, i % UNITS), vbase + src, true);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    // The CTA's next chunk into L2 while this one computes (thread: one K or V row).
    static_assert(THREADS == 2 * CHUNK, "one thread per K and V row of a chunk");
    prefetch_row(threadIdx.x < CHUNK ? kbase : vbase, kv_row, (c + cstep) * CHUNK + (threadIdx.x & (CHUNK - 1)),
                 c + cstep < cend, len, 0, max_len);
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();  // K is in
    int ti = warp;
    if (ti < tiles) scores(qlo + 16 * ti);  // the first tile's scores while V lands
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // V is in
    for (; ti < tiles; ti += NWARP) {
      if (ti != warp) scores(qlo + 16 * ti);
      values(qlo + 16 * ti, c);
    }
  }
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
// TREE (attn_tree_chunk, for T > 1 where a chunk's K and V fit the shared memory): the walking slot CTAs run
// tree_prefix_partials; items and tail CTAs run chunk_partials, as attn_decode_chunk does for all. (An item
// holds a few query tiles, which left most of tree_prefix_partials' warps idle: session 30 measured the
// 27B verify at 1k 9.57 ms with items on it, 9.47 without, 9.49 on attn_decode_chunk.)
// PIPE (attn_decode_chunk_pipe): walking slot CTAs with one query tile load their next chunk's K during this
// one (chunk_partials).
template <bool TREE, bool PIPE>
__device__ __forceinline__ void chunk_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                             const bf16* __restrict__ vc, const int* __restrict__ length,
                                             const long long* __restrict__ mask, float* __restrict__ part_acc,
                                             float* __restrict__ part_ml, int nkv, int max_len, int nch, int T) {
  extern __shared__ uint4 smem[];  // SMEM_BYTES (82 KB at d = 256), TREE: at least TSMEM_BYTES (dynamic)
  pdl_begin();
  const int h = blockIdx.x, slots = gridDim.y - T, nh = nkv * G;
  const int len = min(*length, nch * CHUNK);
  const size_t kv_row = (size_t)nkv * D;
  const bf16* kbase = kc + h * D;
  const bf16* vbase = vc + h * D;
  // This CTA's chunks c0, c0 + cstep, ... < cend for query rows [qlo, qhi), keys < n in slots (len, mk).
  int c0, cstep = 1, cend, qlo, qhi, n = len;
  u64 mk = 0;
  bool walk = false;  // a slot CTA walking chunks z, z + slots, ...
  const bool tail = blockIdx.y >= slots;
  if (tail) {  // tail CTA of row y
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
      walk = true;
    } else {  // item z: chunk z % nb, the z / nb-th group of `per` m16 query tiles
      const int per = (tiles + groups_max - 1) / groups_max;
      if (z >= nb * ((tiles + per - 1) / per)) return;
      c0 = z % nb;
      cend = c0 + 1;
      qlo = z / nb * per * 16;
      qhi = min(rows, qlo + per * 16);
    }
  }
  if (TREE && walk)
    tree_prefix_partials(c0, cstep, cend, qlo, qhi, len, q, kbase, vbase, kv_row, max_len, h, nh, nch, part_acc,
                         part_ml, smem);
  else
    chunk_partials<PIPE>(c0, cstep, cend, qlo, qhi, n, len, mk, q, kbase, vbase, kv_row, max_len, h, nh, nch,
                         part_acc, part_ml, reinterpret_cast<float*>(smem), walk);
}

#define CHUNK_ARGS                                                                                          \
  const bf16 *__restrict__ q, const bf16 *__restrict__ kc, const bf16 *__restrict__ vc,                    \
      const int *__restrict__ length, const long long *__restrict__ mask, float *__restrict__ part_acc,     \
      float *__restrict__ part_ml, int nkv, int max_len, int nch, int T
// q [T, nkv*G, D], kc / vc [max_len, nkv, D], length [1] (committed positions), mask [T] (tree-slot bits per
// row), part_acc [T, nkv*G, nch, D], part_ml [T, nkv*G, nch, 2].
extern "C" __global__ void __launch_bounds__(THREADS) attn_decode_chunk(CHUNK_ARGS) {
  chunk_kernel<false, false>(q, kc, vc, length, mask, part_acc, part_ml, nkv, max_len, nch, T);
}
extern "C" __global__ void __launch_bounds__(THREADS) attn_decode_chunk_pipe(CHUNK_ARGS) {
  chunk_kernel<false, true>(q, kc, vc, length, mask, part_acc, part_ml, nkv, max_len, nch, T);
}
extern "C" __global__ void __launch_bounds__(THREADS) attn_tree_chunk(CHUNK_ARGS) {
  chunk_kernel<true, false>(q, kc, vc, length, mask, part_acc, part_ml, nkv, max_len, nch, T);
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
  // Group grp's chunks grp + MERGE_GROUPS i, i < ng. Its max M first, lane-strided then across the warp (a
  // max is exact: any order gives its bits); then the fold in chunk order, MERGE_BATCH chunks at a time:
  // lane j computes the batch's j-th factor f = e^(m - M) and reads its l, every lane takes both by shuffle,
  // and a batch's accumulator loads are all issued before its first fma. The operations and their order
  // are those of one lane walking the chunks (session 30: the same bits as that loop, with ~ng / MERGE_BATCH
  // load round trips instead of ng / 4: one row at 128k 26.9 -> 10.0 us).
  constexpr int MERGE_BATCH = 32 / PER;
  const int ng = nc > grp ? (nc - grp + MERGE_GROUPS - 1) / MERGE_GROUPS : 0;
  float M = -INFINITY;
  for (int i = lane; i < ng; i += 32) M = fmaxf(M, part_ml[(base + grp + MERGE_GROUPS * i) * 2]);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  float L = 0.0f, A[PER] = {};
  for (int i0 = 0; i0 < ng; i0 += MERGE_BATCH) {
    float f = 0.0f, l = 0.0f;
    if (lane < MERGE_BATCH && i0 + lane < ng) {
      const size_t r = base + grp + MERGE_GROUPS * (i0 + lane);
      f = expf(part_ml[r * 2] - M);
      l = part_ml[r * 2 + 1];
    }
    float a[MERGE_BATCH][PER];
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j)
#pragma unroll
      for (int kb = 0; kb < PER; ++kb)
        a[j][kb] = i0 + j < ng ? part_acc[(base + grp + MERGE_GROUPS * (i0 + j)) * D + k0 + 32 * kb + lane]
                               : 0.0f;
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j) {
      if (i0 + j >= ng) break;  // warp-uniform
      const float fj = __shfl_sync(0xffffffffu, f, j), lj = __shfl_sync(0xffffffffu, l, j);
      L = fmaf(lj, fj, L);
#pragma unroll
      for (int kb = 0; kb < PER; ++kb) A[kb] = fmaf(a[j][kb], fj, A[kb]);
    }
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
