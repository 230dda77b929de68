"""Small kernels of the speculative event (tree_ops.cu) and their torch references.

- `topk_select`: the drafter's candidate selection: top-k ids of draft logits (logit descending, ties by
  lower id), scattered into the tree's token buffer through `draft_node_table` (node of (depth, rank)).
- `tree_accept`: lumo.engine.tree.accept on the GPU; writes the accepted node list (GDN replay rows,
  conv_state_commit rows, KV remap list), the accepted count and the emitted tokens for the one host copy.
- `kv_remap`: moves the accepted K/V from tree slots len + node to positions len + j in every cache.
Data-dependent sizes (count, length) stay on the device, so each is replayable from a CUDA graph.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.tree import TreeBuffers, accept
from .compile import Kernel, compile_kernel
from .sampling import PATH_MAX, Penalties

KMAX = 8  # largest k of topk_select (tree_ops.cu)
TK_SPAN = 4096  # logits per topk_partial CTA (tree_ops.cu)
TK_THREADS = 256
KV_THREADS = 128  # 16-byte columns per kv_remap CTA


@functools.cache
def _kernel(name: str, logits_bf16: bool = False) -> Kernel:
    return compile_kernel("tree_ops.cu", name, {"KMAX": KMAX, **({"LOGITS_BF16": 1} if logits_bf16 else {})})


def _check_i32(x: torch.Tensor, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    if x.dtype != torch.int32 or tuple(x.shape) != shape or not x.is_contiguous() or x.device != device:
        raise ValueError(
            f"{what} must be contiguous int32 {list(shape)} on {device}, got {x.dtype} {tuple(x.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# Candidate selection.


def draft_node_table(tree: TreeBuffers, k: int | None = None) -> torch.Tensor:
    """[D, k] int32: row d-1 holds the node carrying the rank-r candidate at depth d (-1: none).
    k defaults to the tree's candidates per depth (its largest rank + 1)."""
    k = int(tree.rank.max()) + 1 if k is None else k
    table = torch.full((tree.depth_max, k), -1, dtype=torch.int32)
    for i in range(1, tree.n_nodes):
        d, r = int(tree.depth[i]), int(tree.rank[i])
        if r >= k:
            raise ValueError(f"node {i} has rank {r}, beyond k = {k}")
        table[d - 1, r] = i
    return table


def topk_workspace(t: int, v: int, device: torch.device | str) -> torch.Tensor:
    """Per-CTA candidates for t rows of a v-entry vocabulary: int64 [t, ceil(v / 4096), 8]."""
    return torch.empty(t, -(-v // TK_SPAN), KMAX, dtype=torch.int64, device=device)


def topk_select(
    logits: torch.Tensor,
    k: int,
    out: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
    nodes: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    id_map: torch.Tensor | None = None,
    penalties: Penalties | None = None,
    n_path: int = 0,
) -> torch.Tensor:
    """Top-k ids [T, k] int32 of logits [T, V] f32 or bf16 (k <= 8), logit descending, ties by lower id.

    With tokens ([R] int32, the tree's token buffer) and nodes ([T, k] int32, rows of draft_node_table),
    also tokens[nodes[t, r]] = ids[t, r] wherever nodes[t, r] >= 0 (node ids < R, not checked).
    With id_map ([V] int32: the token of each logits column, a draft vocabulary in ascending order, so
    ties still go to the lower token) the ids written are id_map[column].
    With penalties (the sampler's: params [T, 4], bias, counts and prompt over token ids; path /
    node_tokens unused) the logits are biased and penalised first (lumo.engine.sampling.adjust), the
    history being counts plus tokens[1 : 1 + n_path] (the spine drafted so far; needs tokens): the
    drafter's candidates under the request's logit bias and penalties.
    Pass out= and workspace= (topk_workspace) on the hot path: then nothing is allocated. Never syncs.
    """
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(
            f"topk_select: logits must be contiguous f32 or bf16 [T, V], got {logits.dtype} {logits.shape}"
        )
    T, V = logits.shape
    if not 1 <= k <= min(KMAX, V):
        raise ValueError(f"topk_select: k must be in 1..{min(KMAX, V)}, got {k}")
    if V >= 1 << 31:
        raise ValueError("topk_select: vocabulary too large for int32 ids")
    dev = logits.device
    nb = -(-V // TK_SPAN)
    if workspace is None:
        workspace = topk_workspace(T, V, dev)
    if workspace.dtype != torch.int64 or workspace.shape != (T, nb, KMAX) or not workspace.is_contiguous():
        raise ValueError(f"topk_select: workspace must be contiguous int64 [{T}, {nb}, {KMAX}]")
    if out is None:
        out = torch.empty(T, k, dtype=torch.int32, device=dev)
    _check_i32(out, (T, k), "topk_select: out", dev)
    if (tokens is None) != (nodes is None):
        raise ValueError("topk_select: pass tokens and nodes together")
    if tokens is not None:
        if tokens.dim() != 1:
            raise ValueError(f"topk_select: tokens must be int32 [R], got {tuple(tokens.shape)}")
        _check_i32(tokens, tuple(tokens.shape), "topk_select: tokens", dev)
        _check_i32(nodes, (T, k), "topk_select: nodes", dev)
    if id_map is not None:
        if id_map.dim() != 1:
            raise ValueError(f"topk_select: id_map must be int32 [{V}], got {tuple(id_map.shape)}")
        _check_i32(id_map, (V,), "topk_select: id_map", dev)
    null = ctypes.c_void_p(0)  # the kernel's nullptr: no scatter, no map, no penalties
    pen: list = [null, null, null, null, null, 0]
    if penalties is not None:
        p = penalties
        if p.params.shape != (T, 4) or p.params.dtype != torch.float32 or not p.params.is_contiguous():
            raise ValueError(f"topk_select: penalties.params must be contiguous f32 [{T}, 4]")
        spine = tokens.numel() - 1 if tokens is not None else 0
        if not 0 <= n_path <= min(PATH_MAX, spine):
            raise ValueError(f"topk_select: n_path {n_path} needs tokens of >= n_path + 1 (<= {PATH_MAX})")
        bias_ok = p.bias is None or (
            p.bias.dtype == torch.float32
            and p.bias.shape == p.counts.shape
            and p.bias.is_contiguous()
            and p.bias.device == dev
        )
        if not bias_ok:
            raise ValueError(
                f"topk_select: penalties.bias must be contiguous f32 shaped like counts on {dev}"
            )
        bias = null if p.bias is None else p.bias
        pen = [p.params, bias, p.counts, p.prompt, null if tokens is None else tokens, n_path]
    if T == 0:
        return out
    _kernel("topk_partial", logits.dtype == torch.bfloat16).launch(
        (nb, T), TK_THREADS, [logits, V, workspace, nb, *pen, null if id_map is None else id_map], pdl=True
    )
    extra = [tokens, nodes] if tokens is not None else [null, null]
    extra.append(null if id_map is None else id_map)
    _kernel("topk_final").launch(T, 32, [workspace, nb, k, out, *extra], pdl=True)
    return out


def topk_select_ref(logits: torch.Tensor, k: int) -> torch.Tensor:
    """ids [T, k] int32: a stable descending sort (ties keep the lower id first; NaN first, -0 == +0)."""
    order = torch.sort(logits.float().cpu(), dim=-1, descending=True, stable=True).indices
    return order[:, :k].to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Acceptance.


def accept_buffers(cap: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [cap] int32, result [cap + 2] int32) for tree_accept; cap = D + 1."""
    return (
        torch.empty(cap, dtype=torch.int32, device=device),
        torch.empty(cap + 2, dtype=torch.int32, device=device),
    )


def tree_accept(
    tokens: torch.Tensor,
    choice: torch.Tensor,
    parent: torch.Tensor,
    n_nodes: int,
    accepted: torch.Tensor | None = None,
    result: torch.Tensor | None = None,
    cap: int | None = None,
    count_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lumo.engine.tree.accept on the device, one warp.

    tokens [R] int32 (token of each node, node 0 = the pending token), choice [R] int32 (the target's
    choice at each node: sample_tokens at position len + depth + 1), parent [R] int32; n_nodes <= 64 real
    nodes. Returns (accepted [cap] int32: node ids root first, -1 padded; result [cap + 2] int32:
    result[0] = n accepted nodes (root included; also the number of emitted tokens), result[1] = the new
    pending token, result[2 : 2 + n] = emitted tokens (accepted drafts, then the pending one), -1 padded).
    cap defaults to accepted's length or R; use D + 1. `result[:1]` is the count for gdn_decode's
    commit replay and kv_remap; `accepted` their rows (and conv_state_commit's). count_out [V] int32: a
    token histogram the emitted tokens are added to (the sampling penalties'), or None.
    """
    dev = tokens.device
    R = tokens.shape[0] if tokens.dim() == 1 else -1
    if not 1 <= n_nodes <= min(R, 64):
        raise ValueError(f"tree_accept: need 1 <= n_nodes <= min(rows, 64), got {n_nodes} for {R} rows")
    for name, x in (("tokens", tokens), ("choice", choice), ("parent", parent)):
        _check_i32(x, (R,), f"tree_accept: {name}", dev)
    if cap is None:
        cap = accepted.shape[0] if accepted is not None else R
    if accepted is None or result is None:
        accepted, result = accept_buffers(cap, dev)
    _check_i32(accepted, (cap,), "tree_accept: accepted", dev)
    _check_i32(result, (cap + 2,), "tree_accept: result", dev)
    if cap < 1:
        raise ValueError("tree_accept: cap must be >= 1")
    if count_out is not None:
        _check_i32(count_out, (count_out.shape[0],), "tree_accept: count_out", dev)
    counts = ctypes.c_void_p(None) if count_out is None else count_out
    _kernel("tree_accept").launch(
        1, 32, [tokens, choice, parent, n_nodes, cap, accepted, result, counts], pdl=True
    )
    return accepted, result


def tree_accept_ref(
    tree: TreeBuffers, tokens: Sequence[int] | torch.Tensor, choice: Sequence[int] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_accept's outputs from lumo.engine.tree.accept (cap = D + 1)."""
    tok = [int(x) for x in tokens]
    path, pending = accept(tree, tok, [int(x) for x in choice])
    cap = tree.depth_max + 1
    emitted = [tok[i] for i in path[1:]] + [pending]
    accepted = torch.tensor(path + [-1] * (cap - len(path)), dtype=torch.int32)
    result = torch.tensor([len(path), pending] + emitted + [-1] * (cap - len(emitted)), dtype=torch.int32)
    return accepted, result


# ---------------------------------------------------------------------------------------------
# KV remap.


@dataclass(frozen=True)
class KVTable:
    """Device pointer table of same-shaped caches (every attention layer's K and V), built once."""

    ptrs: torch.Tensor  # [L] int64 data pointers, on the caches' device
    caches: tuple[torch.Tensor, ...]  # the caches themselves ([max_len, nkv, d] each): keeps them alive
    max_len: int
    row_vec: int  # 16-byte columns per cache row (nkv * d * itemsize / 16)


def kv_table(caches: Sequence[torch.Tensor]) -> KVTable:
    if not caches:
        raise ValueError("kv_table: no caches")
    c0 = caches[0]
    for c in caches:
        if c.shape != c0.shape or c.dtype != c0.dtype or c.device != c0.device or not c.is_contiguous():
            raise ValueError("kv_table: caches must be contiguous, of one shape, dtype and device")
        if c.data_ptr() % 16:
            raise ValueError("kv_table: caches must be 16-byte aligned")
    row_bytes = c0[0].numel() * c0.element_size()
    if row_bytes % 16:
        raise ValueError(f"kv_table: a cache row of {row_bytes} bytes is not a multiple of 16")
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=c0.device)
    return KVTable(ptrs, tuple(caches), c0.shape[0], row_bytes // 16)


def kv_remap(table: KVTable, accepted: torch.Tensor, count: torch.Tensor, length: torch.Tensor) -> None:
    """In every cache of `table`: row length + accepted[j] -> row length + j for j = 1 .. count-1 in order
    (skipped where accepted[j] == j). accepted [cap] int32, count [1] int32 (tree_accept's result[:1]),
    length [1] int32 (committed positions before this event), all on the device. Never syncs."""
    dev = table.ptrs.device
    if accepted.dim() != 1:
        raise ValueError(f"kv_remap: accepted must be int32 [cap], got {tuple(accepted.shape)}")
    _check_i32(accepted, tuple(accepted.shape), "kv_remap: accepted", dev)
    _check_i32(count, (1,), "kv_remap: count", dev)
    _check_i32(length, (1,), "kv_remap: length", dev)
    grid = (table.ptrs.shape[0], -(-table.row_vec // KV_THREADS))
    args = [table.ptrs, table.row_vec, table.max_len, accepted, count, accepted.shape[0], length]
    _kernel("kv_remap").launch(grid, KV_THREADS, args, pdl=True)


def kv_remap_ref(
    caches: Sequence[torch.Tensor], accepted: Sequence[int] | torch.Tensor, count: int, length: int
) -> list[torch.Tensor]:
    """New caches: the sequential in-place loop of the kernel on clones (row length + a_j -> length + j)."""
    out = [c.clone() for c in caches]
    acc = [int(x) for x in accepted][:count]
    for j, a in enumerate(acc):
        if a < 0:
            break
        if length + a >= out[0].shape[0]:
            break  # the kernel's guard against a bad length
        if a != j:
            for c in out:
                c[length + j] = c[length + a]
    return out
