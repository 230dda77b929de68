// Programmatic dependent launch (sm_90 and newer; no-ops elsewhere and when launched without PDL).
//
// A kernel launched with the programmatic-stream-serialization attribute (Kernel.launch(pdl=True)) may
// start while the kernel before it in the stream is still running, once every CTA of that kernel has
// called pdl_trigger() or exited. Before pdl_wait() it may only read memory that no earlier kernel
// writes (weights) and must write nothing; pdl_wait() returns when the earlier kernel has completed and
// its writes are visible. Kernels that precede a PDL launch call pdl_trigger() as soon as they have no
// more use for SM resources that the next kernel's prologue could use well. In lumo every kernel but the
// prefill's weight dequantisation is PDL-launched: the GEMVs read weights, wait, and trigger after their
// main loop; the row kernels load their weights (norm, conv, A_log / dt_bias) and ask L2 for the rows
// they will read (pdl_prefetch_l2), then pdl_begin() (wait, then trigger), except the gated norm and the
// attention merge, the row kernels right before the out-projections, which trigger first (pdl_begin_early,
// below). The plain decode step's fused GDN recurrence + norm (gdn_recurrent_norm) waits first: its
// trigger then places the out-projection where the gated norm's did, right after the recurrence's wait.
//
// Contract of what a GEMV reads before pdl_wait(): its weights, which no kernel of the step writes (they
// are packed at load). A kernel that writes a weight right before a PDL GEMV would need a pdl_wait()
// first in that GEMV. pdl_wait() compiles to nothing below sm_90, so PDL launches (Kernel.launch) are
// only made for cubins of sm_90 and newer; a kernel compiled for an older arch override must not be
// launched with pdl=True.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The start of a row kernel (norms, conv, GDN, attention, sampling, tree ops): wait for every earlier
// kernel's writes, then let the next kernel launch (its CTAs wait in their own pdl_wait, or prefetch
// weights). Called by every CTA before it reads anything an earlier kernel may write, writes anything or
// exits (only loads of weights and pdl_prefetch_l2 may come before it), it keeps the chain transitive:
// this kernel completes only after its predecessor has. Waiting first keeps at most one kernel placed
// ahead of the running one; triggering first let a run of row kernels place several kernels' CTAs at
// once (H200, 27B decode step at 1k: 5.96 -> 5.73 ms with this order).
__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_trigger();
}

// pdl_begin's other order, trigger then wait, for a row kernel right before a GEMV that follows a run of
// latency-bound kernels (the gated norm after the GDN recurrence, the attention merge after the chunks):
// the GEMV's CTAs are placed while this kernel still waits, and their L2 prefetch of its weights overlaps
// the kernels before it (H200, 27B decode step at 1k: 5.354 -> 5.320 ms for the gated norm, session 14).
// The chain stays transitive (this kernel completes only after its predecessor: it waits before any
// write); the GEMV reads nothing before its own pdl_wait but its weights. In rmsnorm1p_residual (before
// the other GEMVs) it was slower, 5.354 -> 5.467 ms: there the GEMV's prefetch competes with the previous
// GEMV's tail.
__device__ __forceinline__ void pdl_begin_early() {
  pdl_trigger();
  pdl_wait();
}

// Ask L2 for the line holding p. Allowed before pdl_wait() whatever earlier kernels write: L2 is the
// device's point of coherence, so the line is only brought in early, and a later write updates it.
__device__ __forceinline__ void pdl_prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
