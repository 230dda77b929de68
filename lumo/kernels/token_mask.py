"""A structured output's token mask on bf16 logits rows, in place (token_mask.cu; lumo.engine.grammar
computes the bitmasks on the host). `apply_token_mask_ref` is the torch reference."""

from __future__ import annotations

import functools

import torch

from ..engine.grammar import bitmask_words, unpack_bitmask
from .compile import Kernel, compile_kernel

THREADS = 256
MAX_CTAS = 64  # CTAs per row: a 248k vocabulary in 16 strides of the grid


@functools.cache
def _kernel() -> Kernel:
    return compile_kernel("token_mask.cu", "apply_token_mask")


def _check(logits: torch.Tensor, mask: torch.Tensor, on: torch.Tensor) -> tuple[int, int, int]:
    if logits.dim() != 2 or logits.dtype != torch.bfloat16 or not logits.is_contiguous():
        raise ValueError(f"logits must be contiguous bf16 [T, V], got {logits.dtype} {list(logits.shape)}")
    T, V = logits.shape
    W = bitmask_words(V)
    if mask.dtype != torch.int32 or tuple(mask.shape) != (T, W) or not mask.is_contiguous():
        raise ValueError(f"mask must be contiguous int32 [{T}, {W}], got {mask.dtype} {list(mask.shape)}")
    if on.dtype != torch.int32 or tuple(on.shape) != (T,) or not on.is_contiguous():
        raise ValueError(f"on must be contiguous int32 [{T}], got {on.dtype} {list(on.shape)}")
    if not logits.device == mask.device == on.device:
        raise ValueError("logits, mask and on must be on one device")
    return T, V, W


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """logits [T, V] bf16: where on[t] != 0, the tokens whose bit is 0 in mask[t] ([T, ceil(V / 32)] int32)
    become -inf, in place. No host sync (graph-capturable: the host fills mask and on before a replay)."""
    T, V, W = _check(logits, mask, on)
    if T:
        grid = (min(MAX_CTAS, -(-V // THREADS)), T)
        _kernel().launch(grid, THREADS, [logits, mask, on, V, W], pdl=True)
    return logits


def apply_token_mask_ref(logits: torch.Tensor, mask: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """The reference, in place: the rows with on set masked with their bits unpacked."""
    T, V, _ = _check(logits, mask, on)
    for t in range(T):
        if int(on[t]):
            allowed = unpack_bitmask(mask[t].cpu(), V).to(logits.device)
            logits[t].masked_fill_(~allowed, float("-inf"))
    return logits
