"""lumo.kernels: the only module that touches NVRTC / the CUDA driver (imported lazily, so CPU-only is fine).

Each op is a .cu source, a thin launcher and a plain fp32 torch reference side by side.
"""

from __future__ import annotations

from .attention import attn_decode, attn_decode_ref, attn_decode_workspace, attn_prefill, attn_prefill_ref
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
from .conv import (
    conv_commit_rows,
    conv_decode,
    conv_gather,
    conv_gather_ref,
    conv_pred,
    conv_pred_chain,
    conv_prefill,
    conv_prefill_ref,
    conv_state_commit,
    conv_state_commit_ref,
)
from .gdn import gdn_decode, gdn_decode_ref, gdn_dvt, gdn_prefill, gdn_prefill_ref
from .gdn_tree import gdn_tree, gdn_tree_ref
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
from .norms import gated_rmsnorm, gated_rmsnorm_ref, rmsnorm1p, rmsnorm1p_ref
from .rope_kv import qk_norm_rope_kv, qk_norm_rope_kv_ref, rope_inv_freq
from .sampling import gumbel_noise_ref, sample_tokens, sample_tokens_ref, sample_workspace
from .tree_ops import (
    KVTable,
    accept_buffers,
    draft_node_table,
    kv_remap,
    kv_remap_ref,
    kv_table,
    topk_select,
    topk_select_ref,
    topk_workspace,
    tree_accept,
    tree_accept_ref,
)

__all__ = [
    "KVTable",
    "accept_buffers",
    "draft_node_table",
    "gdn_tree",
    "gdn_tree_ref",
    "kv_remap",
    "kv_remap_ref",
    "kv_table",
    "topk_select",
    "topk_select_ref",
    "topk_workspace",
    "tree_accept",
    "tree_accept_ref",
    "attn_decode",
    "attn_decode_ref",
    "attn_decode_workspace",
    "attn_prefill",
    "attn_prefill_ref",
    "gumbel_noise_ref",
    "sample_tokens",
    "sample_tokens_ref",
    "sample_workspace",
    "conv_commit_rows",
    "conv_decode",
    "conv_gather",
    "conv_gather_ref",
    "conv_pred",
    "conv_pred_chain",
    "conv_prefill",
    "conv_prefill_ref",
    "conv_state_commit",
    "conv_state_commit_ref",
    "gated_rmsnorm",
    "gated_rmsnorm_ref",
    "gdn_decode",
    "gdn_decode_ref",
    "gdn_dvt",
    "gdn_prefill",
    "gdn_prefill_ref",
    "qk_norm_rope_kv",
    "qk_norm_rope_kv_ref",
    "rmsnorm1p",
    "rmsnorm1p_ref",
    "rope_inv_freq",
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
