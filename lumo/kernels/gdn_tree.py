"""Path-parallel GDN tree verifier (gdn_tree.cu) and its fp32 torch reference.

One warp per (root-to-leaf path, value head, dv tile) walks the path's tree rows from the committed state
with gdn_step.cuh's per-token code (the decode kernel's, same DVT), writes o for the rows the path owns and
never writes the state. So every node's o is bitwise what `gdn_decode` gives when the node's root-to-node
path is decoded token by token from the same state. Commit replays the accepted rows with
`gdn_decode(rows=accepted, count=n)` on the persistent state (tree_ops.tree_accept makes both).
"""

from __future__ import annotations

import torch

from .gdn import _check_operands, _kernel, _out_rows, gdn_decode_ref, gdn_dvt


def _check_index(x: torch.Tensor, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    if x.dtype != torch.int32 or tuple(x.shape) != shape or not x.is_contiguous() or x.device != device:
        raise ValueError(
            f"{what} must be contiguous int32 {list(shape)} on {device}, got {x.dtype} {tuple(x.shape)}"
        )


def gdn_tree(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    paths: torch.Tensor,
    path_len: torch.Tensor,
    owner: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """GDN outputs of the R tree rows; the state is only read.

    mixed [R, C] bf16 post-conv [q | k | v] rows (row stride % 8 == 0, 16-byte aligned); a, b [R, nv] bf16
    raw in_proj_a / in_proj_b outputs; A_log, dt_bias [nv] (both f32 or both bf16); state [nv, dk, dv] f32
    (the committed state, never written); paths [P, D+1] int32 root-to-leaf node ids (-1 past the leaf),
    path_len [P] int32, owner [R] int32 (TreeBuffers, on the device; node ids < R, not checked).
    Returns o [R, nv, dv] (`out`, or out_dtype): rows with owner -1 are left as they were.
    Never syncs; allocates only when `out` is None.
    """
    nk, nv, dk, dv = _check_operands(mixed, a, b, A_log, dt_bias, state)
    R = mixed.shape[0]
    if paths.dim() != 2:
        raise ValueError(f"paths must be int32 [P, D+1], got {tuple(paths.shape)}")
    P, L = paths.shape
    _check_index(paths, (P, L), "paths", mixed.device)
    _check_index(path_len, (P,), "path_len", mixed.device)
    _check_index(owner, (R,), "owner", mixed.device)
    out = _out_rows(out, R, nv, dv, out_dtype, mixed.device)
    if R == 0 or P == 0 or L == 0:
        return out
    param_bf16, out_bf16 = A_log.dtype == torch.bfloat16, out.dtype == torch.bfloat16
    kern = _kernel("gdn_tree", "gdn_tree", nk, nv, dk, dv, param_bf16, out_bf16)
    args = [mixed, mixed.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, state, out]
    args += [paths, L, path_len, owner]
    kern.launch((P, nv, dv // gdn_dvt(dk, dv)), 32, args)
    return out


def gdn_tree_ref(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    paths: torch.Tensor,
    path_len: torch.Tensor,
    owner: torch.Tensor,
) -> torch.Tensor:
    """fp32 o [R, nv, dv]: each path decoded token by token (gdn_decode_ref) from `state`, its owned rows
    kept; rows no path owns are 0. Pure (state untouched)."""
    R, nv, dv = mixed.shape[0], state.shape[0], state.shape[2]
    o = torch.zeros(R, nv, dv, dtype=torch.float32)
    own = owner.tolist()
    for p in range(paths.shape[0]):
        nodes = paths[p, : int(path_len[p])].long().cpu()
        rows = [x.cpu()[nodes] for x in (mixed, a, b)]
        o_p, _ = gdn_decode_ref(*rows, A_log.cpu(), dt_bias.cpu(), state.cpu())
        for i, u in enumerate(nodes.tolist()):
            if own[u] == p:
                o[u] = o_p[i]
    return o
