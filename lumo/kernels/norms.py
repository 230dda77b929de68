"""Row norms: rmsnorm1p with a fused residual add, and the GDN gated output norm. Kernels in norms.cu.

Both are batch invariant: a row's reduction order depends only on H (or dv), never on T or the row's
position in the launch (norms.cu says how).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from .compile import Kernel, compile_kernel
from .trace import on_trace_change, trace_defines

GWARPS = 4  # gated_rmsnorm: warps (heads) per CTA, must match norms.cu


def rms_threads(h: int) -> int:
    """CTA size of rmsnorm1p_residual for hidden size H: a function of H only (it fixes the sum order).

    One 8-value vector per thread up to H = 8192 (640 threads at H = 5120): a decode row is a latency
    problem (one CTA), so every load of the row is in flight at once."""
    return 32 if h <= 256 else min(1024, -(-h // 256) * 32)


@functools.cache
def _kernel(name: str, hid: int = 5120, dv: int = 128, o_f32: int = 1) -> Kernel:
    defines = {"HID": hid, "NT": rms_threads(hid), "DV": dv, "O_F32": o_f32}
    if name == "rmsnorm1p_residual":
        defines |= trace_defines()  # bench/trace_step.py only; empty otherwise
    return compile_kernel("norms", name, defines)


on_trace_change(_kernel.cache_clear)


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def _check_aligned(t: torch.Tensor, name: str) -> None:
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")


def rmsnorm1p(
    h: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = rmsnorm1p(h, w, eps), after `h += delta` in bf16 when delta is given (h updated in place).

    h [T, H] bf16 (the residual stream), delta [T, H] bf16 or None, w [H] bf16. Returns y [T, H] bf16.
    """
    if h.dim() != 2:
        raise ValueError(f"h must be [T, H], got {list(h.shape)}")
    T, H = h.shape
    if H % 8:
        raise ValueError(f"rmsnorm1p needs H % 8 == 0, got H={H}")
    _check(h, "h", torch.bfloat16, (T, H))
    _check(w, "w", torch.bfloat16, (H,))
    tensors = [("h", h), ("w", w)]
    if delta is not None:
        _check(delta, "delta", torch.bfloat16, (T, H))
        tensors.append(("delta", delta))
    if out is None:
        out = torch.empty_like(h)
    _check(out, "out", torch.bfloat16, (T, H))
    for name, t in [*tensors, ("out", out)]:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        _check_aligned(t, name)
    if T == 0:
        return out
    d = ctypes.c_void_p(0) if delta is None else delta
    _kernel("rmsnorm1p_residual", hid=H).launch(T, rms_threads(H), [h, d, w, out, float(eps)], pdl=True)
    return out


def gated_rmsnorm(
    o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """GDN output norm per value head: y = w * rmsnorm(bf16(o)) * silu(z) (plain weight, not 1+w).

    o [T, nv, dv] f32 or bf16 (an f32 o is rounded to bf16 first, as lumo.model does); z [T, nv, dv] bf16;
    both may have any row stride (views into a fused projection output) but contiguous heads.
    w [dv] bf16. Returns y [T, nv * dv] bf16 (contiguous).
    """
    if o.dim() != 3 or z.dim() != 3:
        raise ValueError(f"o and z must be [T, nv, dv], got {list(o.shape)} and {list(z.shape)}")
    T, nv, dv = o.shape
    if dv % 32:
        raise ValueError(f"gated_rmsnorm needs dv % 32 == 0, got dv={dv}")
    if o.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"o must be f32 or bf16, got {o.dtype}")
    _check(z, "z", torch.bfloat16, (T, nv, dv))
    _check(w, "w", torch.bfloat16, (dv,))
    if out is None:
        out = torch.empty(T, nv * dv, dtype=torch.bfloat16, device=o.device)
    _check(out, "out", torch.bfloat16, (T, nv * dv))
    for name, t in (("o", o), ("z", z)):
        if t.stride(2) != 1 or t.stride(1) != dv:
            raise ValueError(f"{name} must have contiguous heads (strides [*, {dv}, 1]), got {t.stride()}")
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name} rows must be 16-byte aligned")
    if not out.is_contiguous() or not w.is_contiguous() or out.data_ptr() % 16 or w.data_ptr() % 16:
        raise ValueError("out and w must be contiguous and 16-byte aligned")
    if T == 0:
        return out
    kern = _kernel("gated_rmsnorm", dv=dv, o_f32=int(o.dtype == torch.float32))
    grid = -(-(T * nv) // GWARPS)
    o_rs, z_rs = ctypes.c_longlong(o.stride(0)), ctypes.c_longlong(z.stride(0))  # long long in the kernel
    kern.launch(grid, 32 * GWARPS, [o, o_rs, z, z_rs, w, out, T, nv, float(eps)], pdl=True)
    return out


# ---------------------------------------------------------------------------------------------
# fp32 references (plain torch, any device).


def rmsnorm1p_ref(
    h: torch.Tensor, w: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y f32 [T, H], new residual h in h's dtype). The residual add rounds to h's dtype (the
    model's residual stream is bf16); everything after it is fp32."""
    if delta is not None:
        h = (h.float() + delta.float()).to(h.dtype)
    x = h.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y, h


def gated_rmsnorm_ref(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """f32 [T, nv * dv]; o is rounded to bf16 first, like lumo.model.gdn_mixer."""
    of = o.to(torch.bfloat16).float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * w.float() * F.silu(z.float())
    return y.reshape(o.shape[0], -1)


def silu_mul(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """act = silu(gate) * up for gu [T, 2I] = [gate | up] bf16 -> [T, I] bf16, rounded like torch's
    F.silu then torch.mul on bf16 (silu to bf16, then the product to bf16). One launch."""
    if gu.dim() != 2 or gu.shape[1] % 16:
        raise ValueError(f"silu_mul needs gu [T, 2I] with I % 8 == 0, got {list(gu.shape)}")
    T, I = gu.shape[0], gu.shape[1] // 2  # noqa: E741
    _check(gu, "gu", torch.bfloat16, (T, 2 * I))
    if out is None:
        out = torch.empty(T, I, dtype=torch.bfloat16, device=gu.device)
    _check(out, "out", torch.bfloat16, (T, I))
    for name, t in (("gu", gu), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        _check_aligned(t, name)
    if T:
        _kernel("silu_mul").launch(-(-(T * I // 8) // 256), 256, [gu, out, T, I], pdl=True)
    return out


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """torch's own two ops on bf16 (the arithmetic silu_mul reproduces)."""
    g, u = gu.chunk(2, dim=-1)
    return torch.mul(torch.nn.functional.silu(g), u)
