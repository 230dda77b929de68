"""Gated delta rule (GDN) on the GPU: decode / replay / prefill (sequential or chunked), fp32 references.

One kernel (gdn.cu `gdn_recurrent`) walks T tokens of one sequence with the [dk, DVT] state tile of each
(value head, dv tile) in one warp's registers. Its per-token step is gdn_step.cuh, shared with the tree
verifier, so T tokens in one launch equal T one-token launches bit for bit. Inputs are what
lumo.model.gdn_mixer has after the causal conv: mixed [T, C] = [q nk*dk | k nk*dk | v nv*dv] bf16 and the
raw in_proj_a / in_proj_b outputs; l2norm, q scaling, the gate g and beta are computed in the kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .compile import Kernel, compile_kernel
from .trace import on_trace_change, trace_defines


def gdn_dvt(dk: int, dv: int) -> int:
    """State columns per warp. Part of the arithmetic (it fixes the dk reduction tree), so a function of
    (dk, dv) only: the tree verifier must use the same value. 16 at both model-family shapes."""
    for dvt in (16, 8, 4):
        rg = 32 // (dvt // 4)  # row groups per warp
        if dv % dvt == 0 and dk % (2 * rg) == 0:
            return dvt
    raise ValueError(f"GDN kernel needs dv % 4 == 0 and dk % 64 == 0 at least, got dk={dk} dv={dv}")


@functools.cache
def _kernel(
    source: str, name: str, nk: int, nv: int, dk: int, dv: int, param_bf16: bool, out_bf16: bool
) -> Kernel:
    """A GDN kernel (gdn_recurrent, gdn_tree) for one head shape; DVT is part of the arithmetic."""
    defines = _head_defines(nk, nv, dk, dv, param_bf16, out_bf16) | {"DVT": gdn_dvt(dk, dv)}
    if name == "gdn_recurrent_norm":
        defines |= trace_defines()  # bench/trace_step.py only; empty otherwise
    return compile_kernel(source, name, defines)


on_trace_change(_kernel.cache_clear)


def _head_defines(nk: int, nv: int, dk: int, dv: int, param_bf16: bool, out_bf16: bool) -> dict[str, int]:
    """The defines every GDN kernel source takes: head shape and parameter / output dtypes."""
    return {"NK": nk, "NV": nv, "DK": dk, "DV": dv, "PARAM_BF16": int(param_bf16), "OUT_BF16": int(out_bf16)}


def _out_rows(
    out: torch.Tensor | None, T: int, nv: int, dv: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The o buffer [T, nv, dv] f32/bf16: allocated when not given, checked when given."""
    if out is None:
        out = torch.empty(T, nv, dv, dtype=dtype, device=device)
    if (
        out.dtype not in (torch.float32, torch.bfloat16)
        or out.shape != (T, nv, dv)
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be contiguous f32/bf16 [{T}, {nv}, {dv}], got {out.dtype} {tuple(out.shape)}"
        )
    if out.data_ptr() % 16:
        raise ValueError("out must be 16-byte aligned")
    return out


def _heads(mixed: torch.Tensor, state: torch.Tensor) -> tuple[int, int, int, int]:
    """(nk, nv, dk, dv) from mixed [T, C] and state [nv, dk, dv]."""
    if state.dim() != 3:
        raise ValueError(f"state must be [nv, dk, dv], got {tuple(state.shape)}")
    nv, dk, dv = state.shape
    rest = mixed.shape[-1] - nv * dv
    nk = rest // (2 * dk)
    if rest <= 0 or rest % (2 * dk) or nv % nk:
        raise ValueError(f"mixed width {mixed.shape[-1]} is not 2*nk*{dk} + {nv}*{dv} with nv % nk == 0")
    return nk, nv, dk, dv


def _check_state(s: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if s.dtype != torch.float32 or tuple(s.shape) != shape or not s.is_contiguous() or s.data_ptr() % 16:
        raise ValueError(
            f"{what} must be contiguous 16-byte aligned f32 {list(shape)}, got {s.dtype} {tuple(s.shape)}"
        )


def _check_gates(A_log: torch.Tensor, dt_bias: torch.Tensor, nv: int) -> None:
    if A_log.dtype != dt_bias.dtype or A_log.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"A_log / dt_bias must both be f32 or both bf16, got {A_log.dtype} / {dt_bias.dtype}"
        )
    if (
        A_log.shape != (nv,)
        or dt_bias.shape != (nv,)
        or not (A_log.is_contiguous() and dt_bias.is_contiguous())
    ):
        raise ValueError(f"A_log / dt_bias must be contiguous [{nv}]")


def _check_operands(mixed, a, b, A_log, dt_bias, state) -> tuple[int, int, int, int]:
    """The per-token operands every GDN launcher reads; returns (nk, nv, dk, dv)."""
    nk, nv, dk, dv = _heads(mixed, state)
    R = mixed.shape[0]
    _check_mixed(mixed, mixed.shape[1])
    _check_rows(a, R, nv, "a")
    _check_rows(b, R, nv, "b")
    _check_gates(A_log, dt_bias, nv)
    _check_state(state, (nv, dk, dv), "state")
    _check_device(mixed.device, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state)
    return nk, nv, dk, dv


def _check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Every operand on `device` (a kernel handed another device's pointer would fault, not explain)."""
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the other operands on {device}")


def _check_mixed(mixed: torch.Tensor, C: int) -> None:
    """mixed [R, C] bf16 post-conv rows, 16-byte aligned (the kernels read q / k as 16-byte vectors)."""
    _check_rows(mixed, mixed.shape[0], C, "mixed")
    if mixed.shape[0] and (mixed.stride(0) % 8 or mixed.data_ptr() % 16):
        raise ValueError("mixed rows must be 16-byte aligned (row stride % 8 == 0)")


def _check_rows(x: torch.Tensor, t: int, n: int, what: str) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or tuple(x.shape) != (t, n) or (t and x.stride(1) != 1):
        raise ValueError(
            f"{what} must be bf16 [{t}, {n}] with unit column stride, got {x.dtype} {tuple(x.shape)}"
        )


def gdn_decode(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor | None = None,
    state_out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    rows: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    ba_splitk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gated delta rule over T consecutive tokens of one sequence (decode: T = 1; commit replay: T > 1).

    mixed [T, C] bf16 post-conv [q | k | v] (row stride % 8 == 0, 16-byte aligned); a, b [T, nv] bf16 raw
    in_proj_a / in_proj_b outputs (any row stride); A_log, dt_bias [nv] f32 or bf16 (same dtype);
    state [nv, dk, dv] f32, updated in place unless state_out (same shape) is given, which then receives
    the final state while `state` is left untouched. Returns o [T, nv, dv] (`out`, or out_dtype: bf16 as
    gdn_mixer feeds the gated norm, or f32). Never syncs; allocates only when `out` is None.
    Commit replay: `rows` (int32 [T] on the device, values < mixed rows, not checked) makes token t read
    row rows[t] of mixed / a / b; `count` (int32 [1] on the device) runs only the first min(T, count)
    tokens (o rows past it are left as they were) so one captured graph serves any accepted length.
    `ba_splitk` = (a_part, b_part), f32 [S, nv] views with unit column stride and one slice stride (the b/a
    projection's split-K partials, lumo.kernels.linear.bf16_linear_partials), for one token (T = 1): a and
    b are then bf16 of their slices' sums in slice order, splitk_reduce's bits, summed in this launch
    instead of a reduce launch of their own; `a` and `b` are only checked for shape.
    """
    nk, nv, dk, dv = _check_operands(mixed, a, b, A_log, dt_bias, state)
    T = mixed.shape[0]
    if ba_splitk is not None and (T != 1 or rows is not None or count is not None):
        raise ValueError("ba_splitk serves the one-token decode (T = 1, no rows / count)")
    part = _ba_parts(ba_splitk, nv, mixed.device)
    for name, idx in (("rows", rows), ("count", count)):
        if idx is not None and (idx.dtype != torch.int32 or idx.dim() != 1 or not idx.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous int32 vector, got {idx.dtype} {tuple(idx.shape)}")
    if rows is not None:
        T = rows.shape[0]
    if count is not None and count.shape != (1,):
        raise ValueError(f"count must be int32 [1], got {tuple(count.shape)}")
    if state_out is None:
        state_out = state
    else:
        _check_state(state_out, (nv, dk, dv), "state_out")
    out = _out_rows(out, T, nv, dv, out_dtype, mixed.device)
    if T == 0:
        if state_out is not state:
            state_out.copy_(state)
        return out
    kern = _kernel(
        "gdn", "gdn_recurrent", nk, nv, dk, dv, A_log.dtype == torch.bfloat16, out.dtype == torch.bfloat16
    )
    args = [mixed, mixed.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, state, state_out, out, T]
    args += [ctypes.c_void_p(0) if t is None else t for t in (rows, count)] + part
    kern.launch((nv, dv // gdn_dvt(dk, dv)), 32, args, pdl=True)
    return out


def _ba_parts(ba_splitk: tuple[torch.Tensor, torch.Tensor] | None, nv: int, device: torch.device) -> list:
    """The kernels' (pa, pb, part_stride, ba_splits) arguments for gdn_decode's `ba_splitk` (checked)."""
    if ba_splitk is None:
        return [ctypes.c_void_p(0), ctypes.c_void_p(0), 0, 0]
    pa, pb = ba_splitk
    ok = all(p.dtype == torch.float32 and p.dim() == 2 and p.shape[1] == nv for p in ba_splitk)
    ok = ok and pa.stride(1) == pb.stride(1) == 1
    ok = ok and pa.shape[0] == pb.shape[0] and pa.stride(0) == pb.stride(0)
    if not ok or pa.device != device or pb.device != device:
        raise ValueError(f"ba_splitk must be two f32 [S, {nv}] views with one slice stride")
    if not 1 <= pa.shape[0] <= 16:  # gdn.cu BA_MAX_SPLITS = linear.MAX_SPLITS (gdn.py cannot import it)
        raise ValueError(f"ba_splitk holds 1..16 slices, got {pa.shape[0]}")
    return [pa, pb, pa.stride(0), pa.shape[0]]


def gdn_decode_norm(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    ba_splitk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode token's GDN recurrence and output norm in one launch (gdn.cu `gdn_recurrent_norm`):
    y = gated_rmsnorm(gdn_decode(...), z, norm_w, eps), bitwise those two launches (o rounded to bf16
    first, as the model does), the state updated in place the same way. o itself is not returned.

    mixed [1, C], a, b [1, nv], A_log, dt_bias, state and ba_splitk as gdn_decode (T = 1); z [1, nv, dv]
    bf16 with contiguous heads (a view into the fused projection output is fine), norm_w [dv] bf16.
    Returns y [1, nv * dv] bf16 (`out` if given). Needs dv % 32 == 0 and dv / gdn_dvt(dk, dv) <= 32
    (every model-family shape; `fused_norm_ok`).
    """
    nk, nv, dk, dv = _check_operands(mixed, a, b, A_log, dt_bias, state)
    if mixed.shape[0] != 1:
        raise ValueError(f"gdn_decode_norm runs one token, got {mixed.shape[0]} rows")
    if not fused_norm_ok(dk, dv):
        raise ValueError(f"gdn_decode_norm needs dv % 32 == 0 and at most 32 dv tiles, got dk={dk} dv={dv}")
    part = _ba_parts(ba_splitk, nv, mixed.device)
    if z.dtype != torch.bfloat16 or tuple(z.shape) != (1, nv, dv) or z.stride(2) != 1 or z.stride(1) != dv:
        raise ValueError(
            f"z must be bf16 [1, {nv}, {dv}] with contiguous heads, got {z.dtype} {tuple(z.shape)}"
        )
    if norm_w.dtype != torch.bfloat16 or tuple(norm_w.shape) != (dv,) or not norm_w.is_contiguous():
        raise ValueError(f"norm_w must be contiguous bf16 [{dv}]")
    if out is None:
        out = torch.empty(1, nv * dv, dtype=torch.bfloat16, device=mixed.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (1, nv * dv) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bf16 [1, {nv * dv}]")
    _check_device(mixed.device, z=z, norm_w=norm_w, out=out)
    if any(t.data_ptr() % 16 for t in (z, norm_w, out)):
        raise ValueError("z, norm_w and out must be 16-byte aligned")
    kern = _kernel("gdn", "gdn_recurrent_norm", nk, nv, dk, dv, A_log.dtype == torch.bfloat16, True)
    args = [mixed, a, b, A_log, dt_bias, state, z, norm_w, out, float(eps), *part]
    kern.launch(nv, 32 * (dv // gdn_dvt(dk, dv)), args, pdl=True)
    return out


def fused_norm_ok(dk: int, dv: int) -> bool:
    """Whether gdn_decode_norm serves this head shape (its norm warp needs dv % 32 == 0; one CTA a head)."""
    return dv % 32 == 0 and dv // gdn_dvt(dk, dv) <= 32


# The chunked prefill (gdn_chunk.cu; H200 measurements in docs/kernels-gdn.md).
CHUNK_TOKENS = 64  # gdn_chunk.cu GC
CHUNKED_MIN_TOKENS = 128  # gdn_prefill's default switch (CUDA-core walk: 1.13x the sequential kernel at 128,
# 0.83x at 64, session 20; tensor-core walk: 1.31x at 128, session 21; not re-tuned below 128)
CHUNKED_PIECE_TOKENS = 1024  # tokens per prep + scan pair: bounds the workspace (113 MB at the 27B shape)
CHUNK_SCAN_SPR = 2  # gdn_chunk_scan threads per chunk row (4: 1.35 against 1.19 ms at 2048 tokens)
CHUNK_TC_DVS = 16  # gdn_chunk_scan_tc's widest state tile (32: 3.37 against 3.20 ms per 8k tokens and layer)
CHUNK_SCANS = ("tc", "tc1", "fma")  # gdn_chunk_scan_tc in 3 / 1 tf32 passes, gdn_chunk_scan (CUDA cores)


def gdn_prefill(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor | None = None,
    state_out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    chunked: bool | None = None,
    scan: str | None = None,
) -> torch.Tensor:
    """Prefill T tokens from `state` (same arguments as gdn_decode). From CHUNKED_MIN_TOKENS tokens on
    (`chunked=None`), where the head shape allows it (`chunked_fits`), the chunked form
    (gdn_chunk.cu: all chunks' intra-chunk solves at once, then one walk over the chunks); otherwise, or
    with `chunked=False`, the sequential kernel (bitwise T decode steps). The chunked form is the same
    function in another summation order (fp32 operands; tests bound the difference). Long prompts may be
    fed in pieces: the state carries over.

    `scan` (one of CHUNK_SCANS; default `chunk_scan_default(dk)`) picks the walk's kernel: "tc" the tensor
    cores in three tf32 passes (about fp32's accuracy; dk % 64 == 0), "tc1" one pass (tf32's ~1e-3 bound,
    3e-4 measured; a benchmark knob), "fma" fp32 on CUDA cores."""
    nk, nv, dk, dv = _check_operands(mixed, a, b, A_log, dt_bias, state)
    if scan is not None and (scan not in CHUNK_SCANS or (scan != "fma" and dk % 64)):
        raise ValueError(
            f"scan must be one of {CHUNK_SCANS} ('tc*' needs dk % 64 == 0), got {scan!r} at dk={dk}"
        )
    T = mixed.shape[0]
    if chunked is None:
        chunked = T >= CHUNKED_MIN_TOKENS and chunked_fits(dk, dv)
    if not chunked or T == 0:
        return gdn_decode(mixed, a, b, A_log, dt_bias, state, out, state_out, out_dtype)
    if not chunked_fits(dk, dv):
        raise ValueError(
            f"the chunked GDN prefill needs dk % 4 == 0, dk <= 128, dv % 8 == 0, dk + dv <= 256: {dk}, {dv}"
        )
    if state_out is None:
        state_out = state
    else:
        _check_state(state_out, (nv, dk, dv), "state_out")
    out = _out_rows(out, T, nv, dv, out_dtype, mixed.device)
    param_bf16, out_bf16 = A_log.dtype == torch.bfloat16, out.dtype == torch.bfloat16
    dvs = 16 if dv % 16 == 0 else 8
    prep = _chunk_kernel("gdn_chunk_prep", nk, nv, dk, dv, dvs, param_bf16, out_bf16)
    scan = chunk_scan_default(dk) if scan is None else scan
    if scan == "fma":
        threads = CHUNK_SCAN_SPR * CHUNK_TOKENS
        walk = _chunk_kernel("gdn_chunk_scan", nk, nv, dk, dv, dvs, param_bf16, out_bf16, CHUNK_SCAN_SPR)
    else:
        threads, passes = 128, 3 if scan == "tc" else 1
        dvs = next(d for d in (32, 16, 8) if d <= CHUNK_TC_DVS and dv % d == 0)  # this walk's own tile
        walk = _chunk_kernel("gdn_chunk_scan_tc", nk, nv, dk, dv, dvs, param_bf16, out_bf16, tf32=passes)
    piece = CHUNKED_PIECE_TOKENS  # prep + scan per piece, the state carried over
    ws = torch.empty(
        -(-min(T, piece) // CHUNK_TOKENS) * nv * chunk_floats(dk, dv),
        dtype=torch.float32,
        device=mixed.device,
    )
    src = state
    for s0 in range(0, T, piece):
        tp = min(piece, T - s0)
        n = -(-tp // CHUNK_TOKENS)
        rows = slice(s0, s0 + tp)
        args = [mixed[rows], mixed.stride(0), a[rows], a.stride(0), b[rows], b.stride(0)]
        args += [A_log, dt_bias, tp, ws]
        prep.launch((n, nv), 256, args, shmem=_prep_smem(dk, dv))
        walk.launch((dv // dvs, nv), threads, [ws, n, tp, src, state_out, out[rows]])
        src = state_out
    return out


def chunked_fits(dk: int, dv: int) -> bool:
    """Head shapes gdn_chunk.cu takes (both model-family shapes do)."""
    return dk % 4 == 0 and dk <= 128 and dv % 8 == 0 and dk + dv <= 256


def chunk_scan_default(dk: int) -> str:
    """The chunked walk's kernel: the tensor cores (3 tf32 passes) where dk % 64 == 0, else CUDA cores."""
    return "tc" if dk % 64 == 0 else "fma"


def chunk_floats(dk: int, dv: int) -> int:
    """Workspace floats per (chunk, value head): gdn_chunk.cu CHUNK_FLOATS."""
    c = CHUNK_TOKENS
    return c * (3 * dk + dv) + c * c + 4


def chunked_workspace_bytes(T: int, nv: int, dk: int, dv: int) -> int:
    """The chunked prefill's fp32 workspace for T tokens (memory plans)."""
    return -(-min(T, CHUNKED_PIECE_TOKENS) // CHUNK_TOKENS) * nv * chunk_floats(dk, dv) * 4


def _prep_smem(dk: int, dv: int) -> int:
    """gdn_chunk_prep's dynamic shared memory: kf, qf [GC][dk + 1], A [GC][GC + 4], l, beta [GC] (f32)."""
    c = CHUNK_TOKENS
    return 4 * (2 * c * (dk + 1) + c * (c + 4) + 2 * c)


@functools.cache
def _chunk_kernel(
    name: str,
    nk: int,
    nv: int,
    dk: int,
    dv: int,
    dvs: int,
    param_bf16: bool,
    out_bf16: bool,
    spr: int = 2,
    tf32: int = 3,
) -> Kernel:
    """A gdn_chunk.cu kernel for one head shape, DVS state columns per walking CTA (SPR: gdn_chunk_scan's
    threads per row, TF32: gdn_chunk_scan_tc's passes)."""
    defines = _head_defines(nk, nv, dk, dv, param_bf16, out_bf16) | {"DVS": dvs, "SPR": spr}
    defines |= {"TF32_PASSES": tf32} if name == "gdn_chunk_scan_tc" else {}
    return compile_kernel("gdn_chunk", name, defines)


def _ref_operands(mixed, a, b, A_log, dt_bias, state):
    from ..model import gdn_prepare  # lazy: lumo.model may import lumo.kernels

    nk, nv, dk, dv = _heads(mixed, state)
    T = mixed.shape[0]
    q, k, v = mixed.float().split([nk * dk, nk * dk, nv * dv], dim=-1)
    qn, kn, g, beta = gdn_prepare(
        q.view(T, nk, dk), k.view(T, nk, dk), a.float(), b.float(), A_log.float(), dt_bias.float()
    )
    return qn, kn, v.reshape(T, nv, dv), g, beta, state.float()


def gdn_decode_ref(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 token-by-token reference (lumo.model.gdn_recurrent): (o [T, nv, dv] f32, new state). Pure."""
    from ..model import gdn_recurrent

    return gdn_recurrent(*_ref_operands(mixed, a, b, A_log, dt_bias, state))


def gdn_prefill_ref(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 chunked reference (lumo.model.gdn_chunked): (o [T, nv, dv] f32, new state). Pure."""
    from ..model import gdn_chunked

    return gdn_chunked(*_ref_operands(mixed, a, b, A_log, dt_bias, state), chunk=chunk)
