"""GDN causal conv + SiLU: prefill, gathered decode (one token, chain or tree), state commit (conv.cu).

Decode never writes the state: `conv_gather` reads each row's window through a predecessor table
`pred [T, K-1] int32` (>= 0: a row of x; -1 - s: state column s; oldest first), built once per tree
shape by `conv_pred`. After acceptance `conv_state_commit` appends the accepted rows' inputs. Plain
decoding is the one-row case: pred = conv_pred([-1], K) = [[-1, -2, ..., -(K-1)]], rows = [0].
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .compile import Kernel, compile_kernel
from .gdn import gdn_dvt
from .gdn_tree import _qk_rows

CT = 128  # channels per CTA (conv.cu)
TT = 64  # conv_prefill tokens per thread (conv.cu)


@functools.cache
def _kernel(name: str, k: int) -> Kernel:
    return compile_kernel("conv", name, {"KC": k})


# ---------------------------------------------------------------------------------------------
# Index building (pure, CPU).


def conv_pred(parent: Sequence[int], K: int) -> torch.Tensor:
    """Window table [T, K-1] int32 for rows with parents `parent` (parent[i] < i, -1 for a root).

    Row t's window slot j (oldest first) holds its ancestor at distance m = K-1-j: that ancestor's row
    when the ancestry reaches back that far, else the conv state column (K-1) - (m - depth), encoded
    as -1 - column. A chain is parent = [-1, 0, 1, ...]; plain decoding is parent = [-1].
    """
    rows = []
    for t, p in enumerate(parent):
        if p >= t:
            raise ValueError(f"parent[{t}] = {p} must be < {t} (rows in topological order)")
        anc = []  # ancestors, nearest first
        a = p
        while a >= 0 and len(anc) < K - 1:
            anc.append(a)
            a = parent[a]
        depth = len(anc) if a < 0 else K  # ancestry exhausted at depth; beyond the window otherwise
        win = []
        for m in range(K - 1, 0, -1):  # distance K-1 (oldest) .. 1 (parent)
            win.append(anc[m - 1] if m <= len(anc) else -1 - ((K - 1) - (m - depth)))
        rows.append(win)
    return torch.tensor(rows, dtype=torch.int32).reshape(len(parent), K - 1)


def conv_pred_chain(T: int, K: int) -> torch.Tensor:
    """conv_pred for T consecutive new tokens (T = 1: plain decoding)."""
    return conv_pred([t - 1 for t in range(T)], K)


def conv_commit_rows(path: Sequence[int], capacity: int) -> torch.Tensor:
    """rows [capacity] int32 for conv_state_commit: the accepted rows in order, padded with -1."""
    if len(path) > capacity:
        raise ValueError(f"{len(path)} accepted rows exceed capacity {capacity}")
    return torch.tensor(list(path) + [-1] * (capacity - len(path)), dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Launchers.


def _rs(x: torch.Tensor) -> ctypes.c_longlong:
    return ctypes.c_longlong(x.stride(0))  # the kernels take long long row strides


def _check_x(x: torch.Tensor, C: int) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != C or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 [T, {C}] with contiguous rows, got {x.dtype} {list(x.shape)}")


def _check_wstate(w: torch.Tensor, state: torch.Tensor) -> tuple[int, int]:
    if w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous() or w.shape[1] < 2:
        raise ValueError(f"w must be contiguous bf16 [C, K >= 2], got {w.dtype} {list(w.shape)}")
    C, K = w.shape
    if state.dtype != torch.bfloat16 or tuple(state.shape) != (C, K - 1) or not state.is_contiguous():
        raise ValueError(
            f"state must be contiguous bf16 [{C}, {K - 1}], got {state.dtype} {list(state.shape)}"
        )
    return C, K


def _out(out: torch.Tensor | None, T: int, C: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(T, C, dtype=torch.bfloat16, device=device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (T, C) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bf16 [{T}, {C}], got {out.dtype} {list(out.shape)}")
    return out


def conv_prefill(
    x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(causal conv) of x [T, C] bf16 after the state [C, K-1] bf16; the state becomes the last K-1
    inputs (in place). w [C, K] bf16. Returns y [T, C] bf16."""
    C, K = _check_wstate(w, state)
    _check_x(x, C)
    T = x.shape[0]
    out = _out(out, T, C, x.device)
    if T == 0:
        return out
    grid = (-(-C // CT), -(-T // TT))
    _kernel("conv_prefill", K).launch(grid, CT, [x, _rs(x), w, state, out, T, C], pdl=True)
    return out


def conv_gather(
    x: torch.Tensor,
    w: torch.Tensor,
    state: torch.Tensor,
    pred: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode-side conv: row t of y [T, C] = silu(conv(window of pred[t], x[t])); the state is only read.

    pred [T, K-1] int32 on the device (conv_pred); entries must index rows of x or state columns.
    """
    C, K = _check_wstate(w, state)
    _check_x(x, C)
    T = x.shape[0]
    if pred.dtype != torch.int32 or tuple(pred.shape) != (T, K - 1) or not pred.is_contiguous():
        raise ValueError(f"pred must be contiguous int32 [{T}, {K - 1}], got {pred.dtype} {list(pred.shape)}")
    out = _out(out, T, C, x.device)
    if T == 0:
        return out
    _kernel("conv_gather", K).launch((-(-C // CT), T), CT, [x, _rs(x), w, state, pred, out, C], pdl=True)
    return out


def _qk_block(dk: int) -> int:
    """conv_gather_qk's channels per CTA: whole warps and whole q / k heads, at least CT."""
    unit = math.lcm(dk, 32)
    return unit * -(-CT // unit)


@functools.cache
def _qk_kernel(k: int, nk: int, nv: int, dk: int, dv: int) -> Kernel:
    defines = {"KC": k, "NK": nk, "NV": nv, "DK": dk, "DV": dv, "DVT": gdn_dvt(dk, dv), "QT": _qk_block(dk)}
    return compile_kernel("conv", "conv_gather_qk", defines)


def conv_gather_qk(
    x: torch.Tensor,
    w: torch.Tensor,
    state: torch.Tensor,
    pred: torch.Tensor,
    heads: tuple[int, int, int, int],
    out: torch.Tensor | None = None,
    qk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_gather of a GDN layer's conv, which also writes the rows' normalised q and k for gdn_tree.

    heads = (nk, nv, dk, dv); x's channels are [q (nk*dk) | k (nk*dk) | v (nv*dv)]. Returns (y [T, C] bf16,
    qk [T, 2*nk*dk] f32: l2norm(q) * dk^-0.5 and l2norm(k) of y's rows, bitwise what the GDN kernels compute
    for them; gdn_tree(qk=...) reads it instead of normalising in every warp of a head).
    """
    C, K = _check_wstate(w, state)
    _check_x(x, C)
    nk, nv, dk, dv = heads
    if C != 2 * nk * dk + nv * dv:
        raise ValueError(f"conv width {C} is not 2*{nk}*{dk} + {nv}*{dv}")
    T = x.shape[0]
    if pred.dtype != torch.int32 or tuple(pred.shape) != (T, K - 1) or not pred.is_contiguous():
        raise ValueError(f"pred must be contiguous int32 [{T}, {K - 1}], got {pred.dtype} {list(pred.shape)}")
    qt = _qk_block(dk)
    if qt > 1024:
        raise ValueError(
            f"conv_gather_qk: a CTA of whole q / k heads of dk = {dk} needs {qt} threads (> 1024)"
        )
    out = _out(out, T, C, x.device)
    qk = _qk_rows(qk, T, 2 * nk * dk, x.device)
    if T == 0:
        return out, qk
    _qk_kernel(K, nk, nv, dk, dv).launch(
        (-(-C // qt), T), qt, [x, _rs(x), w, state, pred, out, qk, C], pdl=True
    )
    return out, qk


def conv_state_commit(state: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> None:
    """Append x[rows[0]], x[rows[1]], ... (up to the first negative entry) to the state [C, K-1] in place."""
    if state.dtype != torch.bfloat16 or state.dim() != 2 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous bf16 [C, K-1], got {state.dtype} {list(state.shape)}")
    C, K = state.shape[0], state.shape[1] + 1
    _check_x(x, C)
    if rows.dtype != torch.int32 or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous int32 [n], got {rows.dtype} {list(rows.shape)}")
    if rows.numel() == 0 or K < 2:
        return
    _kernel("conv_state_commit", K).launch(
        -(-C // CT), CT, [state, x, _rs(x), rows, rows.numel(), C], pdl=True
    )


def conv_decode_operands(w: torch.Tensor, state: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(C, K) of conv_decode's weights w [C, K], state [C, K-1] and output [1, C] (all contiguous bf16),
    checked: conv_decode's and the GEMV-fused decode conv's (lumo.kernels.linear.nvfp4_linear(conv=...))."""
    C, K = _check_wstate(w, state)
    _out(out, 1, C, w.device)
    return C, K


def conv_decode(
    x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One new token (a plain decode step): y [1, C] = silu(conv(state's window, x[0])), then x[0] is
    appended to the state, in one launch: the bits of conv_gather over the state + conv_state_commit. The
    runner's step usually runs it in the q/k/v/z GEMV's epilogue instead (nvfp4_linear(conv=...))."""
    C, K = _check_wstate(w, state)
    _check_x(x, C)
    if x.shape[0] != 1:
        raise ValueError(f"conv_decode takes one token, got x {list(x.shape)}")
    out = _out(out, 1, C, x.device)
    _kernel("conv_decode", K).launch(-(-C // CT), CT, [x, w, state, out, C], pdl=True)
    return out


# ---------------------------------------------------------------------------------------------
# fp32 references.


def _conv_silu_ref(windows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """windows [T, C, K] (oldest first, the row's own input last) -> f32 [T, C]."""
    return F.silu((windows.float() * w.float()).sum(-1))


def conv_prefill_ref(
    x: torch.Tensor, w: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y f32 [T, C], new state [C, K-1] in state's dtype)."""
    K = w.shape[1]
    full = torch.cat([state.float(), x.float().t()], dim=1)  # [C, K-1+T]
    windows = full.unfold(1, K, 1).transpose(0, 1)  # [T, C, K]
    return _conv_silu_ref(windows, w), full[:, full.shape[1] - (K - 1) :].to(state.dtype)


def conv_gather_ref(
    x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, pred: torch.Tensor
) -> torch.Tensor:
    """f32 [T, C]: each row's window gathered through pred (rows of x, or -1 - state column)."""
    pred = pred.long().to(x.device)
    T = x.shape[0]
    xs = torch.cat([x.float(), state.float().t()])  # [T + K-1, C]: row T + s is state column s
    idx = torch.where(pred >= 0, pred, T - 1 - pred)  # -1 - s -> T + s
    windows = torch.cat([xs[idx], x.float()[:, None]], dim=1)  # [T, K, C]
    return _conv_silu_ref(windows.transpose(1, 2), w)


def conv_state_commit_ref(state: torch.Tensor, x: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """New state: the last K-1 of cat(state, x[r] for r in rows up to the first negative r)."""
    keep = []
    for r in rows:
        if r < 0:
            break
        keep.append(int(r))
    full = torch.cat([state, x[keep].t().to(state.dtype)], dim=1)
    return full[:, full.shape[1] - state.shape[1] :]
