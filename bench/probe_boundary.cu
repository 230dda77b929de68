// Kernel-boundary probe (bench/probe_boundary.py): a chain of launches in one CUDA graph, each reading the
// value its predecessor wrote and writing its own, so no launch can finish before the one before it. Every
// CTA waits (PDL, pdl.cuh) and then spins for `spin_ns` of %globaltimer (a stand-in for a kernel's work);
// the time per launch less the spin is what a kernel boundary costs on this GPU.
//
// lumo:test-defines EARLY=0
// lumo:test-defines EARLY=1

#include "pdl.cuh"

#ifndef EARLY
#define EARLY 0  // 1: trigger the next launch before the wait (pdl_begin_early), as the gated norm does
#endif

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void chain_step(float* buf, int i, int spin_ns) {
#if EARLY
  pdl_begin_early();
#else
  pdl_begin();
#endif
  const unsigned long long t0 = now_ns();
  while (now_ns() - t0 < (unsigned long long)spin_ns) {
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) buf[i] = (i > 0 ? buf[i - 1] : 0.0f) + 1.0f;
}
