"""CPU: the GDN kernel references (lumo.kernels.gdn) against an explicit fp64 recurrence and gdn_mixer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lumo.kernels.gdn import gdn_decode, gdn_decode_norm, gdn_decode_ref, gdn_dvt, gdn_prefill_ref
from lumo.model import causal_conv, gated_rmsnorm, gdn_mixer, linear
from lumo.weights import DenseLinear, GDNWeights


def rand_inputs(T: int, nk: int, nv: int, dk: int, dv: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    a = torch.randn(T, nv, generator=gen) * 2
    if T:
        a[0, 0] = 25.0  # softplus identity branch (x > 20)
    return dict(
        mixed=torch.randn(T, C, generator=gen).to(torch.bfloat16),
        a=a.to(torch.bfloat16),
        b=(torch.randn(T, nv, generator=gen) * 2).to(torch.bfloat16),
        A_log=torch.rand(nv, generator=gen) * 2 - 1,
        dt_bias=torch.randn(nv, generator=gen),
        state=torch.randn(nv, dk, dv, generator=gen),
    )


def explicit_fp64(mixed, a, b, A_log, dt_bias, state, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MODEL.md step 4-6 written out per token and value head, in fp64."""
    nv, dk, dv = state.shape
    S = state.double().clone()
    m = mixed.double()
    o = torch.zeros(m.shape[0], nv, dv, dtype=torch.float64)
    for t in range(m.shape[0]):
        for h in range(nv):
            kh = h // (nv // nk)
            q = m[t, kh * dk : (kh + 1) * dk]
            k = m[t, nk * dk + kh * dk : nk * dk + (kh + 1) * dk]
            v = m[t, 2 * nk * dk + h * dv : 2 * nk * dk + (h + 1) * dv]
            q = q / torch.sqrt((q * q).sum() + 1e-6) / math.sqrt(dk)
            k = k / torch.sqrt((k * k).sum() + 1e-6)
            x = float(a[t, h]) + float(dt_bias[h])
            g = -math.exp(float(A_log[h])) * (x if x > 20 else math.log1p(math.exp(x)))
            beta = 1 / (1 + math.exp(-float(b[t, h])))
            S[h] *= math.exp(g)
            delta = beta * (v - S[h].T @ k)
            S[h] += torch.outer(k, delta)
            o[t, h] = S[h].T @ q
    return o, S


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


SHAPES = [(2, 6, 32, 24), (2, 4, 64, 64), (1, 3, 16, 8)]
IDS = [f"nk{nk}-nv{nv}-dk{dk}-dv{dv}" for nk, nv, dk, dv in SHAPES]


@pytest.mark.parametrize("nk,nv,dk,dv", SHAPES, ids=IDS)
@pytest.mark.parametrize("T", [1, 7])
def test_decode_ref_matches_explicit(T, nk, nv, dk, dv):
    inp = rand_inputs(T, nk, nv, dk, dv, seed=T * 100 + nv)
    state0 = inp["state"].clone()
    o, S = gdn_decode_ref(**inp)
    o64, S64 = explicit_fp64(**inp, nk=nk)
    assert torch.equal(inp["state"], state0), "the reference must not modify its input state"
    assert o.dtype == torch.float32 and o.shape == (T, nv, dv) and S.shape == (nv, dk, dv)
    assert rel(o, o64) < 1e-5 and rel(S, S64) < 1e-5


@pytest.mark.parametrize("T", [63, 150])
def test_prefill_ref_matches_decode_ref(T):
    inp = rand_inputs(T, 2, 6, 32, 24, seed=T)
    o_r, S_r = gdn_decode_ref(**inp)
    for chunk in (16, 64):
        o_c, S_c = gdn_prefill_ref(**inp, chunk=chunk)
        assert rel(o_c, o_r) < 2e-5 and rel(S_c, S_r) < 2e-5


def test_param_dtypes_and_bad_width():
    inp = rand_inputs(3, 2, 4, 32, 16, seed=1)
    o, _ = gdn_decode_ref(**inp)
    o_bf, _ = gdn_decode_ref(
        **{**inp, "A_log": inp["A_log"].bfloat16(), "dt_bias": inp["dt_bias"].bfloat16()}
    )
    assert 0 < rel(o_bf, o) < 0.05  # bf16 gate parameters are accepted (and do change the result)
    with pytest.raises(ValueError, match="mixed width"):
        gdn_decode_ref(**{**inp, "mixed": inp["mixed"][:, :-8]})


def test_dvt_is_a_function_of_the_shape():
    assert gdn_dvt(128, 128) == 16 and gdn_dvt(64, 64) == 16 and gdn_dvt(32, 24) == 8
    with pytest.raises(ValueError, match="dk % 64"):
        gdn_dvt(24, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_operands_are_what_gdn_mixer_has(dtype):
    """Rebuild gdn_mixer from its pieces with gdn_prefill_ref in the middle: the op's inputs and output
    (o rounded to the model dtype before the gated norm) are the model's."""
    nk, nv, dk, dv, H, K, T = 2, 6, 32, 24, 40, 4, 19
    gen = torch.Generator().manual_seed(3)
    C = 2 * nk * dk + nv * dv

    def lin(n: int, k: int) -> DenseLinear:
        return DenseLinear((torch.randn(n, k, generator=gen) * k**-0.5).to(dtype))

    w = GDNWeights(
        in_proj_qkv=lin(C, H),
        in_proj_z=lin(nv * dv, H),
        in_proj_b=lin(nv, H),
        in_proj_a=lin(nv, H),
        conv1d=(torch.randn(C, K, generator=gen) * 0.5).to(dtype),
        dt_bias=torch.randn(nv, generator=gen),
        A_log=torch.rand(nv, generator=gen),
        norm=1 + 0.1 * torch.randn(dv, generator=gen),
        out_proj=lin(H, nv * dv),
    )
    cfg = SimpleNamespace(
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        rms_norm_eps=1e-6,
    )
    x = torch.randn(1, T, H, generator=gen).to(dtype)
    conv0 = torch.randn(1, C, K - 1, generator=gen).to(dtype)
    state0 = torch.randn(1, nv, dk, dv, generator=gen)
    y_model, _, s_model = gdn_mixer(cfg, w, x, conv0, state0)

    mixed, _ = causal_conv(linear(x[0], w.in_proj_qkv), w.conv1d, conv0[0])  # [T, C]
    a, b = linear(x[0], w.in_proj_a), linear(x[0], w.in_proj_b)  # [T, nv]
    o, s = gdn_prefill_ref(mixed.bfloat16(), a.bfloat16(), b.bfloat16(), w.A_log, w.dt_bias, state0[0])
    z = linear(x[0], w.in_proj_z).view(T, nv, dv)
    y = linear(gated_rmsnorm(o.to(dtype), z, w.norm, 1e-6).reshape(T, nv * dv), w.out_proj)
    tol = 1e-6 if dtype == torch.bfloat16 else 1e-2  # f32 model: the kernel's bf16 operands round
    assert rel(y, y_model[0]) < tol and rel(s, s_model[0]) < tol


def test_launcher_rejects_bad_inputs_before_launching():
    from lumo.kernels.gdn import gdn_decode

    inp = rand_inputs(2, 2, 4, 64, 64, seed=2)
    with pytest.raises(ValueError, match="mixed must be bf16"):
        gdn_decode(**{**inp, "mixed": inp["mixed"].float()})
    with pytest.raises(ValueError, match="A_log / dt_bias"):
        gdn_decode(**{**inp, "A_log": inp["A_log"].bfloat16()})
    with pytest.raises(ValueError, match="state must be contiguous"):
        gdn_decode(**{**inp, "state": inp["state"].transpose(1, 2)})
    with pytest.raises(ValueError, match="a must be bf16"):
        gdn_decode(**{**inp, "a": inp["a"][:1]})


def test_chunked_prefill_launcher_facts():
    """gdn.py's mirror of gdn_chunk.cu's workspace layout, the shared memory of its prep kernel on a GB10
    (99 KB per CTA), and the shapes it refuses (checked before any launch, so on the CPU too)."""
    import re
    from pathlib import Path

    from lumo.engine.gpu_weights import config_27b
    from lumo.engine.runner import memory_plan
    from lumo.kernels.gdn import (
        CHUNKED_MIN_TOKENS,
        _prep_smem,
        chunk_floats,
        chunked_fits,
        chunked_workspace_bytes,
        gdn_prefill,
    )

    src = (Path(__file__).parents[1] / "lumo/kernels/gdn_chunk.cu").read_text()
    macros = dict(re.findall(r"^#define (OFF_\w+|CHUNK_FLOATS|GC) (.+?)(?:\s*//.*)?$", src, re.M))
    for dk, dv in ((128, 128), (64, 64), (32, 24), (96, 48)):
        assert chunked_fits(dk, dv) and _prep_smem(dk, dv) <= 99 * 1024
        env = {"DK": dk, "DV": dv}
        for name in ("GC", "OFF_U", "OFF_QG", "OFF_KT", "OFF_P", "OFF_GAMMA", "CHUNK_FLOATS"):
            env[name] = eval(macros[name], {}, dict(env))  # the .cu's own expressions
        assert env["CHUNK_FLOATS"] == chunk_floats(dk, dv)
    assert not chunked_fits(130, 128) and not chunked_fits(128, 12) and not chunked_fits(128, 256)
    inp = rand_inputs(200, 1, 2, 32, 12, seed=1)
    with pytest.raises(ValueError, match="chunked GDN prefill needs"):
        gdn_prefill(**inp, chunked=True)
    # The walk is checked before anything else, whichever path the call would take.
    for chunked in (True, False):
        with pytest.raises(ValueError, match="dk % 64"):
            gdn_prefill(**inp, chunked=chunked, scan="tc")
        with pytest.raises(ValueError, match="scan must be one of"):
            gdn_prefill(**rand_inputs(200, 1, 2, 64, 16, seed=1), chunked=chunked, scan="wgmma")
    plan = memory_plan(config_27b(), 4096)["prefill_chunk"]
    assert 2048 >= CHUNKED_MIN_TOKENS and plan > chunked_workspace_bytes(2048, 48, 128, 128) > 100 << 20


def test_launchers_refuse_operands_on_another_device():
    """The GDN decode launchers check devices before any launch (CPU: meta tensors stand in for a second
    device; nothing is computed)."""
    nv, dv = 4, 64
    inp = rand_inputs(1, 2, nv, 64, dv, seed=0)
    z = torch.zeros(1, nv, dv, dtype=torch.bfloat16)
    w = torch.ones(dv, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="state is on meta"):
        gdn_decode(**{**inp, "state": inp["state"].to("meta")})
    for name, t in (("z", z), ("norm_w", w), ("out", torch.empty(1, nv * dv, dtype=torch.bfloat16))):
        args = dict(z=z, norm_w=w, out=None) | {name: t.to("meta")}
        with pytest.raises(ValueError, match=f"{name} is on meta"):
            gdn_decode_norm(**inp, eps=1e-6, **args)
