// Programmatic dependent launch (sm_90 and newer; no-ops elsewhere and when launched without PDL).
//
// A kernel launched with the programmatic-stream-serialization attribute (Kernel.launch(pdl=True)) may
// start while the kernel before it in the stream is still running, once every CTA of that kernel has
// called pdl_trigger() or exited. Before pdl_wait() it may only read memory that no earlier kernel
// writes (weights) and must write nothing; pdl_wait() returns when the earlier kernel has completed and
// its writes are visible. Kernels that precede a PDL launch call pdl_trigger() as soon as they have no
// more use for SM resources that the next kernel's prologue could use well (lumo: at their start for
// the small row kernels, after the main loop for the GEMVs).
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
