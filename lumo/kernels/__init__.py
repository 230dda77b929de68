"""lumo.kernels: the only module that touches NVRTC / the CUDA driver (imported lazily, so CPU-only is fine).

Each op is a .cu source, a thin launcher and a plain fp32 torch reference side by side.
"""

from __future__ import annotations

from .compile import (
    Kernel,
    KernelCompileError,
    cache_dir,
    clean_cache,
    compile_kernel,
    compile_test_defines,
    compile_to_cubin,
    kernel_sources,
)
from .linear import (
    PackedNVFP4,
    bf16_linear,
    bf16_linear_ref,
    nvfp4_linear,
    nvfp4_linear_ref,
    pack_fused,
    pack_nvfp4,
    split_fused,
    unpack_nvfp4,
)

__all__ = [
    "Kernel",
    "KernelCompileError",
    "PackedNVFP4",
    "bf16_linear",
    "bf16_linear_ref",
    "cache_dir",
    "clean_cache",
    "compile_kernel",
    "compile_to_cubin",
    "kernel_sources",
    "nvfp4_linear",
    "nvfp4_linear_ref",
    "pack_fused",
    "pack_nvfp4",
    "split_fused",
    "compile_test_defines",
    "unpack_nvfp4",
]
