"""CPU: the fp32 references of the norm / RoPE kernels compute lumo.model's functions."""

from __future__ import annotations

import pytest
import torch

from lumo import model
from lumo.kernels.norms import gated_rmsnorm_ref, rms_threads, rmsnorm1p_ref
from lumo.kernels.rope_kv import qk_norm_rope_kv_ref, rope_inv_freq, rope_ref

EPS = 1e-6


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("T,H", [(1, 192), (7, 296), (3, 5120)], ids=lambda v: str(v))
def test_rmsnorm1p_ref_matches_model(T, H):
    gen = torch.Generator().manual_seed(T * H)
    h = torch.randn(T, H, generator=gen) * 3
    w = torch.randn(H, generator=gen) * 0.2
    y, h_same = rmsnorm1p_ref(h, w, EPS)
    assert h_same is h
    assert rel_err(y, model.rmsnorm1p(h, w, EPS)) < 1e-6
    assert rel_err(y, model.rmsnorm1p(h.double(), w.double(), EPS)) < 1e-6


def test_rmsnorm1p_ref_residual_rounds_like_the_model():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, 192, generator=gen).bfloat16()
    delta = (torch.randn(5, 192, generator=gen) * 0.1).bfloat16()
    w = (torch.randn(192, generator=gen) * 0.2).bfloat16()
    y, h_new = rmsnorm1p_ref(h, w, EPS, delta=delta)
    assert h_new.dtype == torch.bfloat16 and torch.equal(h_new, h + delta)  # the model's `h = h + mixer(x)`
    ref = model.rmsnorm1p(h_new.float(), w.float(), EPS)
    assert rel_err(y, ref) < 1e-6
    assert rel_err(y, model.rmsnorm1p(h_new, w, EPS)) < 1e-2  # the model's bf16 output


@pytest.mark.parametrize("T,nv,dv", [(1, 4, 64), (5, 3, 128)], ids=lambda v: str(v))
def test_gated_rmsnorm_ref_matches_model(T, nv, dv):
    gen = torch.Generator().manual_seed(T + nv + dv)
    o = torch.randn(T, nv, dv, generator=gen)  # the GDN output, f32
    z = torch.randn(T, nv, dv, generator=gen).bfloat16()
    w = (1 + 0.3 * torch.randn(dv, generator=gen)).bfloat16()
    y = gated_rmsnorm_ref(o, z, w, EPS)
    assert y.shape == (T, nv * dv) and y.dtype == torch.float32
    # lumo.model rounds o to the model dtype before the norm; evaluated in fp32 from there on
    ref = model.gated_rmsnorm(o.bfloat16().float(), z.float(), w.float(), EPS).reshape(T, -1)
    assert rel_err(y, ref) < 1e-6
    # and without the rounding it is a different function (the reference must not skip it)
    assert rel_err(y, model.gated_rmsnorm(o, z.float(), w.float(), EPS).reshape(T, -1)) > 1e-5


def test_rope_inv_freq_is_the_models():
    x = torch.randn(3, 2, 64)
    pos = torch.tensor([0, 17, 250_000])
    assert rel_err(rope_ref(x, pos, 16, 1e7), model.apply_partial_rope(x, pos, 16, 1e7)) < 1e-6
    assert rope_inv_freq(16, 1e7).shape == (8,)
    assert rope_inv_freq(16, 1e7)[0] == 1.0


@pytest.mark.parametrize(
    "T,nh,nkv,d,rd", [(1, 4, 2, 64, 16), (6, 24, 4, 256, 64), (3, 2, 1, 128, 32)], ids=lambda v: str(v)
)
def test_qk_norm_rope_ref_matches_model(T, nh, nkv, d, rd):
    gen = torch.Generator().manual_seed(T * nh + d)
    qg = torch.randn(T, nh, 2 * d, generator=gen)
    k = torch.randn(T, nkv, d, generator=gen) * 2
    qn, kn = (torch.randn(d, generator=gen) * 0.2 for _ in range(2))
    pos = torch.randint(0, 200_000, (T,), generator=gen)
    q, kr = qk_norm_rope_kv_ref(qg, k, qn, kn, pos, rd, 1e7, EPS)
    q_model = model.apply_partial_rope(model.rmsnorm1p(qg[..., :d], qn, EPS), pos, rd, 1e7)
    k_model = model.apply_partial_rope(model.rmsnorm1p(k, kn, EPS), pos, rd, 1e7)
    assert rel_err(q, q_model) < 1e-6 and rel_err(kr, k_model) < 1e-6
    assert torch.equal(q[..., rd:], model.rmsnorm1p(qg[..., :d], qn, EPS)[..., rd:])  # pass-through dims


def test_rms_threads_depends_on_H_only():
    assert rms_threads(192) == 32 and rms_threads(5120) == 640 and rms_threads(16384) == 1024
