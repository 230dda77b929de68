// Small kernels of the speculative event (DESIGN.md, steps 2, 4, 5): drafter candidate selection,
// acceptance on the GPU and the KV move of the accepted path. All read their data-dependent sizes (accepted
// count, committed length) from device memory, so one captured CUDA graph serves every event.
//
// topk_partial / topk_final: the top-KMAX (8) entries of each row of logits [T, V] f32, ordered by logit
//   descending, ties by lower index (NaN above everything, -0 == +0: torch.sort(descending, stable)).
//   Every entry becomes a unique 64-bit key (orderable float bits << 32 | ~index), so "top k" is the k
//   largest keys and the result does not depend on the reduction order at all.
//   topk_partial grid (NB, T), block TK_THREADS: CTA b keeps the top KMAX keys of [b*TK_SPAN, (b+1)*TK_SPAN).
//   topk_final grid T, one warp: merges the NB*KMAX keys of a row, writes ids[t, r] (r < k) and, where
//   nodes[t, r] >= 0, tokens[nodes[t, r]] (the tree's token buffer: node of (depth, rank)). With an id
//   map (a draft vocabulary: logits column j is token id_map[j], ascending) both get id_map[index].
// tree_accept: one warp; the walk of lumo.engine.tree.accept (see the kernel).
// kv_remap: grid (number of caches, ceil(row_vec / KV_THREADS)); moves accepted K/V rows in place.
//
// topk_partial reads f32 logits, or bf16 with LOGITS_BF16=1 (logits.cuh: the drafter's head output).
//
// lumo:test-defines KMAX=8
// lumo:test-defines KMAX=8 LOGITS_BF16=1

#ifndef KMAX
#define KMAX 8  // largest k of topk_select
#endif
#define TK_SPAN 4096   // logits per topk_partial CTA
#define TK_THREADS 256  // threads per topk_partial CTA
#define KV_THREADS 128  // 16-byte columns per kv_remap CTA

#include "logits.cuh"
#include "pdl.cuh"
#include "penalty.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

// ---------------------------------------------------------------------------------------------------------
// Top-k selection.

__device__ __forceinline__ u64 topk_key(float x, u32 idx) {
  u32 bits = __float_as_uint(x);
  if (x != x) bits = 0x7fffffffu;           // every NaN: one value above +inf
  else if (bits == 0x80000000u) bits = 0u;  // -0 == +0
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // unsigned order == float order
  return ((u64)bits << 32) | (u64)(~idx);  // low word: lower index = larger key; never 0 (idx < 2^31)
}

// Sorted (descending) insert into a register list; key 0 is padding (below every real key).
__device__ __forceinline__ void topk_insert(u64 (&l)[KMAX], u64 key) {
  if (key <= l[KMAX - 1]) return;
  l[KMAX - 1] = key;
#pragma unroll
  for (int i = KMAX - 1; i > 0; --i) {
    if (l[i] > l[i - 1]) {
      const u64 t = l[i];
      l[i] = l[i - 1];
      l[i - 1] = t;
    }
  }
}

// Warp merge: lane-sorted lists -> the warp's top KMAX keys, identical in every lane (out[r], descending).
// Keys are unique, so exactly one lane owns each popped head (padding 0 may pop in several: harmless).
__device__ __forceinline__ void topk_warp_merge(u64 (&l)[KMAX], u64 (&out)[KMAX]) {
#pragma unroll
  for (int r = 0; r < KMAX; ++r) {
    u64 m = l[0];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const u64 o = __shfl_xor_sync(0xffffffffu, m, off);
      m = o > m ? o : m;
    }
    out[r] = m;
    if (l[0] == m) {
#pragma unroll
      for (int i = 0; i < KMAX - 1; ++i) l[i] = l[i + 1];
      l[KMAX - 1] = 0ull;
    }
  }
}

// With penalty (null: none; [T, 4], penalty.cuh) each logit is biased and penalised first (the drafter
// proposes what the target is likely to pick under them): bias / counts / prompt [V_all] are the request's,
// indexed by token id (id_map[column], or the column), and tokens[1 .. n_path] (the spine drafted so far)
// count as generated too.
extern "C" __global__ void __launch_bounds__(TK_THREADS)
    topk_partial(const logit_t* __restrict__ logits, int V, u64* __restrict__ part, int nb,
                 const float* __restrict__ penalty, const float* __restrict__ bias,
                 const int* __restrict__ counts,
                 const unsigned char* __restrict__ prompt, const int* __restrict__ tokens, int n_path,
                 const int* __restrict__ id_map) {
  pdl_begin();
  __shared__ u64 warp_top[TK_THREADS / 32][KMAX];
  __shared__ int ptok[PATH_MAX];
  const int b = blockIdx.x, t = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const logit_t* row = logits + (size_t)t * V;
  const Penalty pen = row_penalty(penalty, bias, t);
  if (pen.on) {
    for (int e = threadIdx.x; e < n_path; e += TK_THREADS) ptok[e] = tokens[1 + e];
    __syncthreads();
  }
  u64 l[KMAX];
#pragma unroll
  for (int i = 0; i < KMAX; ++i) l[i] = 0ull;
  const int end = min(V, (b + 1) * TK_SPAN);
  for (int i = b * TK_SPAN + threadIdx.x; i < end; i += TK_THREADS) {
    float x = logit_f32(__ldg(row + i));
    if (pen.on || pen.bias) {
      const int id = id_map != nullptr ? id_map[i] : i;
      if (pen.bias) x = __fadd_rn(x, bias[id]);
      if (pen.on) {
        int c = counts[id];
        for (int e = 0; e < n_path; ++e) c += ptok[e] == id;
        x = penalized(x, c, prompt[id] != 0, pen);
      }
    }
    topk_insert(l, topk_key(x, i));
  }
  u64 top[KMAX];
  topk_warp_merge(l, top);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < KMAX; ++r) warp_top[warp][r] = top[r];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < KMAX; ++i) l[i] = 0ull;
  for (int i = lane; i < (TK_THREADS / 32) * KMAX; i += 32) topk_insert(l, warp_top[i / KMAX][i % KMAX]);
  topk_warp_merge(l, top);
  if (lane < KMAX) {
    u64 mine = top[0];  // select top[lane] without dynamic register indexing
#pragma unroll
    for (int r = 1; r < KMAX; ++r) mine = lane == r ? top[r] : mine;
    part[((size_t)t * nb + b) * KMAX + lane] = mine;
  }
}

// ids [T, k]; tokens (nullable) [R]; nodes (nullable) [T, k]: tokens[nodes[t, r]] = ids[t, r] when >= 0;
// id_map (nullable) [V]: the id written for logits column j.
extern "C" __global__ void __launch_bounds__(32)
    topk_final(const u64* __restrict__ part, int nb, int k, int* __restrict__ ids, int* __restrict__ tokens,
               const int* __restrict__ nodes, const int* __restrict__ id_map) {
  pdl_begin();
  const int t = blockIdx.x, lane = threadIdx.x;
  u64 l[KMAX];
#pragma unroll
  for (int i = 0; i < KMAX; ++i) l[i] = 0ull;
  const u64* p = part + (size_t)t * nb * KMAX;
  for (int i = lane; i < nb * KMAX; i += 32) topk_insert(l, p[i]);
  u64 top[KMAX];
  topk_warp_merge(l, top);
#pragma unroll
  for (int r = 0; r < KMAX; ++r) {
    if (r < k && lane == r) {
      const int j = (int)(~(u32)(top[r] & 0xffffffffull));
      const int id = id_map != nullptr ? id_map[j] : j;
      ids[(size_t)t * k + r] = id;
      if (nodes != nullptr) {
        const int node = nodes[(size_t)t * k + r];
        if (node >= 0) tokens[node] = id;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Acceptance (lumo.engine.tree.accept): from u = root, take the target's choice c = choice[u]; move to the
// lowest-numbered child v of u (parent[v] == u, v < n_nodes) with tokens[v] == c; stop when none. One warp:
// lane l looks at nodes l and l + 32 (n_nodes <= 64), a ballot finds the children carrying c.
// Outputs: accepted [cap] node ids root first, -1 padded (GDN replay rows, conv_state_commit rows, the KV
// remap list); result [cap + 2]: result[0] = n (accepted nodes, root included = tokens emitted: the GDN
// replay / KV remap count), result[1] = the new pending token, result[2 ..] = the emitted tokens (the
// accepted drafts' tokens, then the pending token), -1 padded. A path longer than cap is cut at cap.
// count_out (or null): a token histogram the emitted tokens are added to (the sampling penalties').

extern "C" __global__ void __launch_bounds__(32)
    tree_accept(const int* __restrict__ tokens, const int* __restrict__ choice, const int* __restrict__ parent,
                int n_nodes, int cap, int* __restrict__ accepted, int* __restrict__ result,
                int* __restrict__ count_out) {
  pdl_begin();
  __shared__ int path[64];
  const int lane = threadIdx.x;
  const bool in0 = lane < n_nodes, in1 = lane + 32 < n_nodes;
  const int par0 = in0 ? parent[lane] : -2, tok0 = in0 ? tokens[lane] : 0;
  const int par1 = in1 ? parent[lane + 32] : -2, tok1 = in1 ? tokens[lane + 32] : 0;
  int u = 0, n = 1, c = choice[0];
  if (lane == 0) path[0] = 0;
  while (n < cap) {
    const u32 m0 = __ballot_sync(0xffffffffu, par0 == u && tok0 == c);
    const u32 m1 = __ballot_sync(0xffffffffu, par1 == u && tok1 == c);
    if (m0 == 0u && m1 == 0u) break;
    u = m0 ? __ffs(m0) - 1 : 32 + __ffs(m1) - 1;
    if (lane == 0) path[n] = u;
    ++n;
    c = choice[u];
  }
  __syncwarp();
  for (int i = lane; i < cap; i += 32) {
    accepted[i] = i < n ? path[i] : -1;
    result[2 + i] = i + 1 < n ? tokens[path[i + 1]] : (i + 1 == n ? c : -1);
  }
  if (lane == 0) {
    result[0] = n;
    result[1] = c;
  }
  if (count_out != nullptr)
    for (int i = lane; i < n; i += 32) atomicAdd(count_out + (i + 1 < n ? tokens[path[i + 1]] : c), 1);
}

// ---------------------------------------------------------------------------------------------------------
// KV remap: for j = 1 .. n-1 in order, row len + accepted[j] (tree slot) -> row len + j (position), unless
// accepted[j] == j (spine prefix: already in place). caches[c] is the base of cache c [max_len, row] (any
// dtype; row_vec 16-byte columns per row); thread x of CTA (c, y) owns column y * KV_THREADS + x.
//
// In place is safe. Rows are in topological order (parent < child), so depth(v) <= v for every node v: the
// node accepted at depth j has index a_j >= j. Each thread walks j upward, reading then writing its own
// column, so its accesses happen in exactly the order of the sequential loop "for j: row[len+j] =
// row[len+a_j]"; no other thread touches that column (no cross-thread race). That loop only reads rows not
// yet overwritten: the move at step j reads row len + a_j, and the rows written earlier are len + i for
// i < j <= a_j. It never overwrites a row it still needs: a later step j' > j reads len + a_j' with
// a_j' >= j' > j, never the row len + j written now. So the result is the out-of-place gather
// new[len + j] = old[len + a_j] (tested against it on the CPU, tests/test_tree_kernels_ref.py).
// The cache pointer is deliberately not __restrict__ / not read through the read-only path: the loads must
// see this thread's earlier stores.

extern "C" __global__ void __launch_bounds__(KV_THREADS)
    kv_remap(const u64* __restrict__ caches, int row_vec, int max_len, const int* __restrict__ accepted,
             const int* __restrict__ count, int cap, const int* __restrict__ length) {
  pdl_begin();
  const int col = blockIdx.y * KV_THREADS + threadIdx.x;
  if (col >= row_vec) return;
  uint4* base = reinterpret_cast<uint4*>(caches[blockIdx.x]);
  const int n = min(*count, cap), len = *length;
  for (int j = 1; j < n; ++j) {
    const int a = accepted[j];
    if (a < 0) break;
    if (a == j) continue;
    const int src = len + a, dst = len + j;
    if (src >= max_len) break;  // never for a verify that fits the cache; guards a bad length
    base[(size_t)dst * row_vec + col] = base[(size_t)src * row_vec + col];
  }
}
