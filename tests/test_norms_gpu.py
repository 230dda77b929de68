"""GPU: rmsnorm1p (+ fused residual) and gated_rmsnorm vs fp32 references and lumo.model, batch invariance."""

from __future__ import annotations

import pytest
import torch

from lumo import model
from lumo.kernels.norms import (
    gated_rmsnorm,
    gated_rmsnorm_ref,
    rmsnorm1p,
    rmsnorm1p_ref,
    silu_mul,
    silu_mul_ref,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
EPS = 1e-6


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def frac_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def nan_bf16(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)


def bf16(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEV) * scale + shift).to(torch.bfloat16)


RMS = [(T, H) for T in (1, 7, 33) for H in (192, 296, 5120)]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("T,H", RMS, ids=[f"T{t}-H{h}" for t, h in RMS])
def test_rmsnorm1p_matches_reference(T, H, residual):
    gen = torch.Generator(DEV).manual_seed(T * 7919 + H + residual)
    h = bf16(gen, T, H, scale=3.0)
    delta = bf16(gen, T, H, scale=0.7) if residual else None
    w = bf16(gen, H, scale=0.2)
    h0 = h.clone()
    y = rmsnorm1p(h, w, EPS, delta=delta, out=nan_bf16(T, H))
    y_ref, h_ref = rmsnorm1p_ref(h0, w, EPS, delta)
    assert torch.equal(h, h_ref)  # the residual stream: exactly bf16(h + delta), or untouched
    assert rel_err(y, y_ref) < 5e-3
    # lumo.model's own bf16 result: differs only where fp32 sum order flips a bf16 rounding
    y_model = model.rmsnorm1p(h_ref, w, EPS)
    assert frac_equal(y, y_model) > 0.98 and rel_err(y, y_model.float()) < 5e-3


@pytest.mark.parametrize("H", [192, 5120])
def test_rmsnorm1p_batch_invariant(H):
    gen = torch.Generator(DEV).manual_seed(H)
    h, delta, w = bf16(gen, 40, H, scale=2.0), bf16(gen, 40, H, scale=0.5), bf16(gen, H, scale=0.2)

    def run(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        hh = h[rows].clone()
        return rmsnorm1p(hh, w, EPS, delta=delta[rows].contiguous()), hh

    single = [run(slice(r, r + 1)) for r in range(40)]
    y1, h1 = torch.cat([s[0] for s in single]), torch.cat([s[1] for s in single])
    for m in (1, 2, 5, 17, 32, 40):
        for start in sorted({0, 40 - m, (40 - m) // 2}):
            y, hh = run(slice(start, start + m))
            assert torch.equal(y, y1[start : start + m]) and torch.equal(hh, h1[start : start + m]), (
                m,
                start,
            )


GATED = [(1, 4, 64), (5, 48, 128), (33, 3, 128), (7, 5, 32)]


@pytest.mark.parametrize("o_dtype", [torch.float32, torch.bfloat16], ids=["o_f32", "o_bf16"])
@pytest.mark.parametrize("T,nv,dv", GATED, ids=[f"T{t}-nv{n}-dv{d}" for t, n, d in GATED])
def test_gated_rmsnorm_matches_reference(T, nv, dv, o_dtype):
    gen = torch.Generator(DEV).manual_seed(T * 131 + nv * 7 + dv)
    o = torch.randn(T, nv, dv, generator=gen, device=DEV).to(o_dtype) * 0.3
    # z as a view into a fused projection output [T, 40 + nv*dv + 24] (row stride != nv*dv)
    fused = bf16(gen, T, 40 + nv * dv + 24, scale=2.0)
    z = fused[:, 40 : 40 + nv * dv].view(T, nv, dv)
    w = bf16(gen, dv, scale=0.3, shift=1.0)
    y = gated_rmsnorm(o, z, w, EPS, out=nan_bf16(T, nv * dv))
    assert rel_err(y, gated_rmsnorm_ref(o, z, w, EPS)) < 5e-3
    y_model = model.gated_rmsnorm(o.to(torch.bfloat16), z, w, EPS).reshape(T, nv * dv)
    assert frac_equal(y, y_model) > 0.98 and rel_err(y, y_model.float()) < 5e-3


def test_gated_rmsnorm_batch_invariant():
    gen = torch.Generator(DEV).manual_seed(17)
    nv, dv = 48, 128
    o = torch.randn(40, nv, dv, generator=gen, device=DEV)
    z = bf16(gen, 40, nv, dv)
    w = bf16(gen, dv, scale=0.3, shift=1.0)
    single = torch.cat([gated_rmsnorm(o[r : r + 1], z[r : r + 1], w, EPS) for r in range(40)])
    for m in (1, 3, 16, 32, 40):
        for start in sorted({0, 40 - m, (40 - m) // 2}):
            y = gated_rmsnorm(o[start : start + m], z[start : start + m], w, EPS)
            assert torch.equal(y, single[start : start + m]), (m, start)


def test_launchers_reject_bad_inputs():
    h = torch.zeros(3, 100, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="H % 8"):
        rmsnorm1p(h, torch.zeros(100, dtype=torch.bfloat16, device=DEV), EPS)
    h = torch.zeros(3, 192, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="w must be"):
        rmsnorm1p(h, torch.zeros(192, dtype=torch.float32, device=DEV), EPS)
    o = torch.zeros(2, 4, 64, device=DEV)
    with pytest.raises(ValueError, match="z must be"):
        gated_rmsnorm(
            o, torch.zeros(2, 4, 64, device=DEV), torch.zeros(64, dtype=torch.bfloat16, device=DEV), EPS
        )


def test_graph_replay_equals_eager():
    gen = torch.Generator(DEV).manual_seed(23)
    T, H, nv, dv = 4, 5120, 48, 128
    h, delta, w = bf16(gen, T, H), bf16(gen, T, H), bf16(gen, H, scale=0.2)
    o, z, gw = torch.randn(T, nv, dv, device=DEV), bf16(gen, T, nv, dv), bf16(gen, dv, shift=1.0)
    y, g = nan_bf16(T, H), nan_bf16(T, nv * dv)
    rmsnorm1p(h.clone(), w, EPS, delta=delta, out=y)  # compile and load outside the capture
    gated_rmsnorm(o, z, gw, EPS, out=g)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rmsnorm1p(h, w, EPS, delta=delta, out=y)
        gated_rmsnorm(o, z, gw, EPS, out=g)
    for _ in range(2):
        h.copy_(bf16(gen, T, H))
        delta.copy_(bf16(gen, T, H))
        o.copy_(torch.randn(T, nv, dv, generator=gen, device=DEV))
        h0 = h.clone()
        y.fill_(float("nan"))
        g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        h_eager = h0.clone()
        assert torch.equal(y, rmsnorm1p(h_eager, w, EPS, delta=delta)) and torch.equal(h, h_eager)
        assert torch.equal(g, gated_rmsnorm(o, z, gw, EPS))


@pytest.mark.parametrize("T,I", [(1, 17408), (3, 24), (32, 136), (77, 1000)])
def test_silu_mul_matches_torch_bitwise(T, I):  # noqa: E741
    """silu_mul is torch's F.silu then torch.mul on bf16 in one launch; compared bit for bit with torch
    on the GPU, and by relative error with an fp32 reference."""
    gen = torch.Generator(device=DEV).manual_seed(T * 7 + I)
    gu = bf16(gen, T, 2 * I, scale=3.0)
    got = silu_mul(gu)
    assert torch.equal(got, silu_mul_ref(gu))
    g, u = gu.float().chunk(2, dim=-1)
    assert rel_err(got, torch.nn.functional.silu(g) * u) < 1e-2
