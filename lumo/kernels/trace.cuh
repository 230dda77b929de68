// Timeline trace (bench/trace_step.py only; the library never sets it). LUMO_TRACE is the address of a
// device buffer of u64 [1 + LUMO_TRACE_CAP, 8]; word 0 counts records (past the end too). A traced kernel's
// thread 0 appends one record per CTA:
//   words 0-2: %globaltimer ns at the CTA's start, after its pdl_wait, and one kernel-specific point;
//   word 3: the CTA's end (thread 0's store); word 4: a second kernel-specific point (0: none);
//   word 5: the kernel (TRACE_KIND below); word 6: smid << 32 | CTAs in the grid; word 7: a pointer that
//   names the launch (its weight, state or norm weight: each runs once per decode step).
// The stamps wait in shared memory, not registers, so that a traced build keeps the plain build's
// occupancy. Without LUMO_TRACE every macro is empty: the plain builds are the untraced code.
#pragma once

#define TRACE_KIND_GEMV 0  // nvfp4_gemv_rd: point 2 = end of warp 0's main loop
#define TRACE_KIND_GDN 1   // gdn_recurrent_norm: 2 = operands prepared, 4 = state stored (before the norm)
#define TRACE_KIND_NORM 2  // rmsnorm1p_residual: 2 = rows loaded and squares summed (before the barrier)

#ifdef LUMO_TRACE
__device__ __forceinline__ unsigned long long trace_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// t: the CTA's stamps in shared memory (start, after the wait, point 2, point 4 if n > 3).
__device__ __forceinline__ void trace_store(const unsigned long long* t, int n, int kind, const void* key) {
  unsigned long long* buf = reinterpret_cast<unsigned long long*>((unsigned long long)LUMO_TRACE);
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const unsigned long long slot = atomicAdd(buf, 1ull);
  if (slot >= LUMO_TRACE_CAP) return;  // full: counted, not stored
  unsigned long long* rec = buf + 8 * (1 + slot);
  rec[0] = t[0], rec[1] = t[1], rec[2] = t[2], rec[3] = trace_ns();
  rec[4] = n > 3 ? t[3] : 0, rec[5] = kind;
  rec[6] = ((unsigned long long)smid << 32) | (gridDim.x * gridDim.y);
  rec[7] = reinterpret_cast<unsigned long long>(key);
}
#define TRACE_DECL(n) __shared__ unsigned long long trace_sm[n]
#define TRACE_AT(i) (threadIdx.x == 0 ? (void)(trace_sm[i] = trace_ns()) : (void)0)
#define TRACE_STORE(n, kind, key) (threadIdx.x == 0 ? trace_store(trace_sm, n, kind, key) : (void)0)
#else
#define TRACE_DECL(n)
#define TRACE_AT(i) ((void)0)
#define TRACE_STORE(n, kind, key) ((void)0)
#endif
