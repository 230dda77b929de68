"""Token log-probabilities on the GPU (logprobs.cu): every row's log_softmax at its token and its k most
likely tokens, one launch for any number of rows, each row's numbers independent of the rows beside it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from .compile import Kernel, compile_kernel

SPAN = 8192  # vocab entries per CTA (logprobs.cu)
THREADS = 256
LIST_SIZES = (0, 1, 2, 4, 8, 20)  # compiled list lengths (KL): the smallest that holds k is used
MAX_K = LIST_SIZES[-1]


@functools.cache
def _kernel(kl: int, logits_bf16: bool) -> Kernel:
    return compile_kernel("logprobs.cu", "lp_rows", {"KL": kl} | ({"LOGITS_BF16": 1} if logits_bf16 else {}))


def _list_size(k: int) -> int:
    return next(n for n in LIST_SIZES if n >= k)


@dataclass
class LogprobsWorkspace:
    """lp_rows' per-CTA partials for up to `rows` rows of a `vocab`-entry vocabulary, and its per-row
    counters (zero between launches). Reusable across calls on one stream."""

    rows: int
    vocab: int
    ms: torch.Tensor  # [rows, NB, 2] f32
    top_v: torch.Tensor  # [rows, NB, MAX_K] f32
    top_i: torch.Tensor  # [rows, NB, MAX_K] i32
    counter: torch.Tensor  # [rows] i32, zeros

    @classmethod
    def new(cls, rows: int, vocab: int, device: torch.device | str) -> LogprobsWorkspace:
        nb = -(-vocab // SPAN)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            rows,
            vocab,
            torch.empty(rows, nb, 2, **f32),
            torch.empty(rows, nb, MAX_K, **f32),
            torch.empty(rows, nb, MAX_K, dtype=torch.int32, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device),
        )


def row_logprobs(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    k: int,
    out: torch.Tensor | None = None,
    workspace: LogprobsWorkspace | None = None,
) -> torch.Tensor:
    """out [T, 1 + 2k] f32 for logits rows [T, V] (f32 or bf16, rows with unit stride) and tokens [T]
    (int64, on the rows' device): out[t, 0] = log_softmax(rows[t])[tokens[t]], out[t, 1:1+k] the k largest
    log-probabilities of row t (ties: lower index first), out[t, 1+k:] their token ids (exact as floats).
    `workspace` (LogprobsWorkspace for >= T rows of V entries) and `out` are made per call if None."""
    if rows.dim() != 2 or rows.dtype not in (torch.float32, torch.bfloat16) or rows.stride(1) != 1:
        raise ValueError("row_logprobs: rows must be f32 or bf16 [T, V] with unit stride along V")
    T, V = rows.shape
    if not 0 <= k <= min(MAX_K, V):
        raise ValueError(f"row_logprobs: k must be in [0, {min(MAX_K, V)}], got {k}")
    if V >= 1 << 24:
        raise ValueError(f"row_logprobs: {V} vocabulary entries: token ids would not be exact as f32")
    if tokens.shape != (T,) or tokens.dtype != torch.int64 or tokens.device != rows.device:
        raise ValueError(f"row_logprobs: tokens must be [{T}] int64 on {rows.device}")
    if T > 65535:  # grid.y; the ids in [0, V) are the caller's to guarantee (checking them would sync)
        raise ValueError(f"row_logprobs: at most 65535 rows per call, got {T}")
    if out is None:
        out = torch.empty(T, 1 + 2 * k, dtype=torch.float32, device=rows.device)
    elif out.shape != (T, 1 + 2 * k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"row_logprobs: out must be a contiguous [{T}, {1 + 2 * k}] f32 tensor")
    if T == 0:
        return out
    if workspace is None:
        workspace = LogprobsWorkspace.new(T, V, rows.device)
    elif workspace.rows < T or workspace.vocab != V or workspace.ms.device != rows.device:
        raise ValueError(f"row_logprobs: the workspace holds {workspace.rows} rows of {workspace.vocab}")
    ws, nb = workspace, -(-V // SPAN)
    # The kernel reads the list buffers as [T, NB, KL] (KL <= MAX_K: a prefix of them).
    ld = ctypes.c_longlong(rows.stride(0))  # long long in the kernel
    args = (rows, ld, V, nb, tokens, ws.ms, ws.top_v, ws.top_i, ws.counter, out, k)
    _kernel(_list_size(k), rows.dtype == torch.bfloat16).launch((nb, T), THREADS, args, pdl=True)
    return out


def row_logprobs_ref(rows: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """row_logprobs in plain fp32 torch (the best k by a stable sort: ties keep the lower index first)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    order = torch.sort(rows.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    parts = [lp.gather(1, tokens.long()[:, None]), lp.gather(1, order), order.float()]
    return torch.cat(parts, dim=1)
