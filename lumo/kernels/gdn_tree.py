"""Path-parallel GDN tree verifier with fork leaves (gdn_tree.cu) and its fp32 torch reference.

One warp per (schedule row, value head, dv tile) runs the row's items (lumo.engine.tree.gdn_schedule)
from the committed state with gdn_step.cuh's per-token code (the decode kernel's, same DVT): a plain item
steps the path's state, a fork item (a leaf) steps a copy of it; WRITE items write o. The state is never
written. So every node's o is bitwise what `gdn_decode` gives when the node's root-to-node path is decoded
token by token from the same state. Commit replays the accepted rows with `gdn_decode(rows=accepted,
count=n)` on the persistent state (tree_ops.tree_accept makes both).

The rows' q and k arrive normalised (`qk`: written once per row and k head by the verify's conv,
conv.conv_gather_qk, or by `gdn_qk` here), and each warp computes its items' gates 32 at a time: the
same values the decode kernel's gdn_prepare computes, so the same bits, without repeating that work in
every warp of a head and on every item's critical path (docs/kernels-tree.md, session 16).
"""

from __future__ import annotations

import torch

from ..engine.tree import GDN_FORK, GDN_NODE, GDN_WRITE
from .compile import sm_count
from .gdn import _check_mixed, _check_operands, _kernel, _out_rows, gdn_decode_ref, gdn_dvt


def _check_index(x: torch.Tensor, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    if x.dtype != torch.int32 or tuple(x.shape) != shape or not x.is_contiguous() or x.device != device:
        raise ValueError(
            f"{what} must be contiguous int32 {list(shape)} on {device}, got {x.dtype} {tuple(x.shape)}"
        )


def gdn_tree_rows(
    nk: int, nv: int, dk: int, dv: int, param_bf16: bool, out_bf16: bool, device: torch.device
) -> int | None:
    """How many schedule rows (each nv x dv / DVT single-warp CTAs) the device holds at once: a cap for
    gdn_schedule(max_rows=...), so a balanced schedule's grid runs in one wave. None off CUDA."""
    if device.type != "cuda":
        return None
    kern = _kernel("gdn_tree", "gdn_tree", nk, nv, dk, dv, param_bf16, out_bf16)
    return max(1, kern.blocks_per_sm(32, 0) * sm_count(device) // (nv * (dv // gdn_dvt(dk, dv))))


def gdn_tree(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    items: torch.Tensor,
    items_len: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    qk: torch.Tensor | None = None,
) -> torch.Tensor:
    """GDN outputs of the R tree rows; the state is only read.

    mixed [R, C] bf16 post-conv [q | k | v] rows (row stride % 8 == 0, 16-byte aligned); a, b [R, nv] bf16
    raw in_proj_a / in_proj_b outputs; A_log, dt_bias [nv] (both f32 or both bf16); state [nv, dk, dv] f32
    (the committed state, never written); items [P', L'] int32 node id | GDN_FORK | GDN_WRITE per schedule
    row (-1 past the end), items_len [P'] int32 (TreeBuffers.gdn_items / gdn_items_len, on the device;
    node ids < R, not checked). qk [R, 2*nk*dk] f32: the rows' normalised q and k (conv_gather_qk's second
    output, or gdn_qk); None computes it here with gdn_qk (one launch more). Returns o [R, nv, dv] (`out`,
    or out_dtype): rows no WRITE item names are left as they were. Never syncs; allocates only when `out`
    (or qk) is None.
    """
    nk, nv, dk, dv = _check_operands(mixed, a, b, A_log, dt_bias, state)
    R = mixed.shape[0]
    if items.dim() != 2:
        raise ValueError(f"items must be int32 [P', L'], got {tuple(items.shape)}")
    P, L = items.shape
    _check_index(items, (P, L), "items", mixed.device)
    _check_index(items_len, (P,), "items_len", mixed.device)
    out = _out_rows(out, R, nv, dv, out_dtype, mixed.device)
    if R == 0 or P == 0 or L == 0:
        return out
    param_bf16, out_bf16 = A_log.dtype == torch.bfloat16, out.dtype == torch.bfloat16
    qk = gdn_qk(mixed, (nk, nv, dk, dv)) if qk is None else _check_qk(qk, R, 2 * nk * dk, mixed.device)
    kern = _kernel("gdn_tree", "gdn_tree", nk, nv, dk, dv, param_bf16, out_bf16)
    args = [mixed, mixed.stride(0), qk, a, a.stride(0), b, b.stride(0), A_log, dt_bias, state, out]
    args += [items, L, items_len]
    kern.launch((P, nv, dv // gdn_dvt(dk, dv)), 32, args, pdl=True)
    return out


def _check_qk(qk: torch.Tensor, R: int, n: int, device: torch.device) -> torch.Tensor:
    if (
        qk.dtype != torch.float32
        or tuple(qk.shape) != (R, n)
        or not qk.is_contiguous()
        or qk.device != device
        or qk.data_ptr() % 16
    ):
        raise ValueError(
            f"qk must be contiguous 16-byte aligned f32 [{R}, {n}] on {device}, got "
            f"{qk.dtype} {tuple(qk.shape)}"
        )
    return qk


def _qk_rows(qk: torch.Tensor | None, R: int, n: int, device: torch.device) -> torch.Tensor:
    """The qk buffer [R, n] f32: allocated when not given, checked when given."""
    return (
        torch.empty(R, n, dtype=torch.float32, device=device) if qk is None else _check_qk(qk, R, n, device)
    )


def gdn_qk(
    mixed: torch.Tensor, heads: tuple[int, int, int, int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """qk [R, 2*nk*dk] f32 of mixed's post-conv rows: l2norm(q) * dk^-0.5 and l2norm(k), one warp per (row,
    head) in the GDN kernels' lane layout (the bits they compute; conv_gather_qk fuses this into the conv).
    heads = (nk, nv, dk, dv)."""
    nk, nv, dk, dv = heads
    R = mixed.shape[0]
    _check_mixed(mixed, 2 * nk * dk + nv * dv)
    out = _qk_rows(out, R, 2 * nk * dk, mixed.device)
    if R:
        kern = _kernel("gdn_tree", "gdn_qk", nk, nv, dk, dv, False, True)
        kern.launch((R, 2 * nk), 32, [mixed, mixed.stride(0), out], pdl=True)
    return out


def gdn_qk_ref(mixed: torch.Tensor, heads: tuple[int, int, int, int]) -> torch.Tensor:
    """fp32 reference of gdn_qk / conv_gather_qk's qk [R, 2*nk*dk]: lumo.model's l2norm(q) * dk^-0.5 and
    l2norm(k)."""
    from ..model import l2norm

    nk, _, dk, _ = heads
    q, k = mixed.float()[:, : 2 * nk * dk].reshape(-1, 2, nk, dk).unbind(1)
    return torch.stack([l2norm(q) * dk**-0.5, l2norm(k)], 1).reshape(-1, 2 * nk * dk)


def gdn_tree_written(items: torch.Tensor, items_len: torch.Tensor, R: int) -> torch.Tensor:
    """bool [R]: the rows some WRITE item names (the rows gdn_tree writes). CPU."""
    written = torch.zeros(R, dtype=torch.bool)
    for p in range(items.shape[0]):
        for it in items[p, : int(items_len[p])].tolist():
            if it & GDN_WRITE:
                written[it & GDN_NODE] = True
    return written


def gdn_tree_ref(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    items: torch.Tensor,
    items_len: torch.Tensor,
) -> torch.Tensor:
    """fp32 o [R, nv, dv]: each walking path's items decoded one token at a time (gdn_decode_ref) from
    `state`, a fork from a copy of the path's state; WRITE items kept, other rows 0. Pure."""
    R, nv, dv = mixed.shape[0], state.shape[0], state.shape[2]
    o = torch.zeros(R, nv, dv, dtype=torch.float32)
    rows = [x.cpu() for x in (mixed, a, b)]
    A_log, dt_bias = A_log.cpu(), dt_bias.cpu()
    for p in range(items.shape[0]):
        s = state.cpu().float()
        for it in items[p, : int(items_len[p])].tolist():
            u = it & GDN_NODE
            o_u, s_u = gdn_decode_ref(*(x[u : u + 1] for x in rows), A_log, dt_bias, s)
            if not it & GDN_FORK:
                s = s_u
            if it & GDN_WRITE:
                o[u] = o_u[0]
    return o
