"""Timeline tracing of the decode step's kernels (diagnostics only: bench/trace_step.py; trace.cuh).

`set_trace(buf)` makes the traced kernels (`nvfp4_gemv_rd`, `gdn_recurrent_norm`, `rmsnorm1p_residual`)
compiled from then on append one record per CTA to `buf`; the modules that build them register their
kernel caches here (`on_trace_change`), so that a change of buffer rebuilds them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_BUF: list[torch.Tensor | None] = [None]  # the builds hold its address: keep it referenced while they run
_CACHES: list[Callable[[], None]] = []


def on_trace_change(clear: Callable[[], None]) -> Callable[[], None]:
    """Register a kernel cache's `cache_clear`, called whenever the trace buffer changes."""
    _CACHES.append(clear)
    return clear


def trace_defines() -> dict[str, int]:
    """The defines of a traced build (LUMO_TRACE, LUMO_TRACE_CAP), or none while tracing is off."""
    buf = _BUF[0]
    return {} if buf is None else {"LUMO_TRACE": buf.data_ptr(), "LUMO_TRACE_CAP": buf.shape[0] - 1}


def set_trace(buf: torch.Tensor | None) -> None:
    """Diagnostics only (bench/trace_step.py): the traced kernels compiled from now on append a record per
    CTA to `buf` (contiguous int64 [1 + records, 8] on the GPU; word 0, zeroed by the caller, counts the
    records, also past the end; trace.cuh), or stop doing so (None). Kernels already loaded keep their
    build: call it before the first launch (or before building the runner whose graph should be traced),
    and replay no traced graph after the buffer is gone. Not thread-safe."""
    if buf is not None and (
        buf.dtype != torch.int64
        or buf.dim() != 2
        or buf.shape[1] != 8
        or buf.shape[0] < 2
        or not buf.is_contiguous()
        or not buf.is_cuda
    ):
        raise ValueError(
            f"the trace buffer must be contiguous int64 [>= 2, 8] on the GPU, got {buf.dtype} "
            f"{tuple(buf.shape)}"
        )
    _BUF[0] = buf
    for clear in _CACHES:
        clear()
