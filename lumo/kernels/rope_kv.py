"""Attention input prep: q/k rmsnorm1p + partial RoPE + K/V cache write in one launch (rope_kv.cu).

Positions and cache slots are int32 device tensors, so a captured CUDA graph replays with new ones.
The gate half of q_proj's output stays where it is (qg[:, :, d:], row stride nh * 2d): attention / the
o_proj input prep reads it strided instead of paying a copy here.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..config import RopeScaling
from ..rope import rope_table
from .compile import Kernel, compile_kernel
from .norms import rmsnorm1p_ref

RWARPS = 4  # warps (heads) per CTA, must match rope_kv.cu


@functools.cache
def _kernel(d: int, rd: int) -> Kernel:
    return compile_kernel("rope_kv", "qk_norm_rope_kv", {"D": d, "RD": rd})


def rope_inv_freq(
    rotary_dim: int, theta: float, device: torch.device | str = "cpu", scaling: RopeScaling | None = None
) -> torch.Tensor:
    """inv_freq [rotary_dim / 2] f32 by lumo.model.apply_partial_rope's own table (lumo.rope; compute it
    once per device and pass it to qk_norm_rope_kv: on the GPU it is then bitwise the model's table). A
    scaling's cos / sin factor is qk_norm_rope_kv's rope_scale (rope_table's second value)."""
    return rope_table(rotary_dim, theta, scaling, device)[0]


def _check_heads(
    t: torch.Tensor, name: str, shape: tuple[int, int, int], head_stride: int, align: int
) -> None:
    if t.dtype != torch.bfloat16 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be bf16 {list(shape)}, got {t.dtype} {list(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != head_stride:
        raise ValueError(f"{name} must have strides [*, {head_stride}, 1], got {t.stride()}")
    if t.data_ptr() % align or (t.stride(0) * 2) % align:
        raise ValueError(f"{name} rows must be {align}-byte aligned")


def _check_index(t: torch.Tensor, name: str, T: int) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != (T,) or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous int32 [{T}], got {t.dtype} {list(t.shape)}")


def qk_norm_rope_kv(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    q_out: torch.Tensor | None = None,
    rope_scale: float = 1.0,
) -> torch.Tensor:
    """q = rope(rmsnorm1p(query)), k_cache[slots] = rope(rmsnorm1p(k)), v_cache[slots] = v.

    qg [T, nh, 2d] bf16 (per head [query d | gate d]); k, v [T, nkv, d] bf16 (any row stride, contiguous
    heads); q_norm, k_norm [d] bf16; positions, slots [T] int32 on the device (slot < 0: row not written);
    k_cache, v_cache [max_len, nkv, d] bf16; inv_freq [rotary / 2] f32 from rope_inv_freq; rope_scale: the
    factor cos and sin are multiplied by (a yarn scaling's attention factor; 1.0 leaves every bit as is).
    Returns q_out [T, nh, d] bf16. The gate stays in qg[:, :, d:].
    """
    if qg.dim() != 3 or k.dim() != 3:
        raise ValueError(f"qg must be [T, nh, 2d] and k [T, nkv, d], got {list(qg.shape)}, {list(k.shape)}")
    T, nh, d2 = qg.shape
    nkv, d = k.shape[1], k.shape[2]
    rd = 2 * inv_freq.numel()
    if d2 != 2 * d or d % 32 or rd == 0 or rd > d or (rd // 2) % (d // 32):
        raise ValueError(f"unsupported head dims: qg last dim {d2}, d={d}, rotary={rd} (need d % 32 == 0)")
    if nh % nkv:
        raise ValueError(f"nh={nh} must be a multiple of nkv={nkv}")
    align = max(4, 2 * (d // 32))
    _check_heads(qg, "qg", (T, nh, 2 * d), 2 * d, align)
    _check_heads(k, "k", (T, nkv, d), d, align)
    _check_heads(v, "v", (T, nkv, d), d, align)
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w.dtype != torch.bfloat16 or tuple(w.shape) != (d,) or not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous bf16 [{d}], got {w.dtype} {list(w.shape)}")
        if w.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not inv_freq.is_contiguous():
        raise ValueError("inv_freq must be contiguous f32 [rotary / 2] (rope_inv_freq)")
    _check_index(positions, "positions", T)
    _check_index(slots, "slots", T)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (
            c.dtype != torch.bfloat16
            or c.dim() != 3
            or tuple(c.shape[1:]) != (nkv, d)
            or not c.is_contiguous()
        ):
            raise ValueError(f"{name} must be contiguous bf16 [max_len, {nkv}, {d}], got {list(c.shape)}")
        if c.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    if q_out is None:
        q_out = torch.empty(T, nh, d, dtype=torch.bfloat16, device=qg.device)
    if q_out.dtype != torch.bfloat16 or tuple(q_out.shape) != (T, nh, d) or not q_out.is_contiguous():
        raise ValueError(f"q_out must be contiguous bf16 [{T}, {nh}, {d}], got {list(q_out.shape)}")
    if q_out.data_ptr() % 16:
        raise ValueError("q_out must be 16-byte aligned")
    if T == 0:
        return q_out
    qs, ks, vs = (ctypes.c_longlong(t.stride(0)) for t in (qg, k, v))  # long long row strides
    args = [qg, qs, k, ks, v, vs, q_norm, k_norm, inv_freq, positions, slots]
    args += [q_out, k_cache, v_cache, nh, nkv, float(eps), float(rope_scale)]
    _kernel(d, rd).launch((T, -(-(nh + nkv) // RWARPS)), 32 * RWARPS, args, pdl=True)
    return q_out


def rope_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """fp32 partial RoPE of x [T, n, d] (rotate_half pairs (j, j + rotary/2) on the first rotary dims)."""
    x = x.float()
    inv, factor = rope_table(rotary_dim, theta, scaling, x.device)
    f = positions.to(x.device, torch.float32)[:, None] * inv  # [T, rd/2]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]  # [T, 1, rd]
    cos, sin = cos * factor, sin * factor
    xr, half = x[..., :rotary_dim], rotary_dim // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rot * sin, x[..., rotary_dim:]], dim=-1)


def qk_norm_rope_kv_ref(
    qg: torch.Tensor,
    k: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float,
    eps: float,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (q [T, nh, d], k [T, nkv, d]) after norm and RoPE; the cache gets k and the untouched v."""
    d = k.shape[-1]
    q = rmsnorm1p_ref(qg[..., :d], q_norm, eps)[0]
    kn = rmsnorm1p_ref(k, k_norm, eps)[0]
    return rope_ref(q, positions, rotary_dim, theta, scaling), rope_ref(
        kn, positions, rotary_dim, theta, scaling
    )
