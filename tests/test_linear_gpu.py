"""GPU: NVFP4 / BF16 linears vs the fp32 dequantise-then-matmul reference, batch invariance, graph replay."""

from __future__ import annotations

import pytest
import torch

from lumo.kernels import (
    bf16_linear,
    bf16_linear_ref,
    nvfp4_linear,
    nvfp4_linear_ref,
    pack_fused,
    pack_nvfp4,
    split_fused,
)
from lumo.kernels.linear import _bf16_splits, smem_limit
from lumo.quant import nvfp4_dequantize

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rand_nvfp4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=DEV)
    s = (torch.rand(n, k // 16, generator=gen, device=DEV) * 300 + 0.002).to(torch.float8_e4m3fn)
    s2 = torch.rand((), generator=gen, device=DEV) * 0.01 + 1e-4
    return w, s, s2


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return ((y.float() - ref).norm() / ref.norm()).item()


def poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)


SHAPES = [(48, 16 * 7), (100, 16 * 33), (200, 16 * 65), (64 * 5 + 3, 16 * 129)]


def stage_spy(monkeypatch) -> list[tuple[bool, int]]:
    """(staged?, shared memory per CTA) of every register-direct launch asked to stage its weights."""
    from lumo.kernels import linear

    fits, log = linear._stage_fits, []
    monkeypatch.setattr(linear, "_stage_fits", lambda *a: log.append((fits(*a), a[2])) or log[-1][0])
    return log


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 32, 33, 70])
@pytest.mark.parametrize("splits", [None, 3])
def test_nvfp4_linear_matches_reference(n, k, m, splits):
    gen = torch.Generator(DEV).manual_seed(n * 1000 + k + m)
    w, s, s2 = rand_nvfp4(n, k, gen)
    packed = pack_nvfp4(w, s, s2, splits=splits)
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    y = nvfp4_linear(x, packed, out=poisoned(m, n))
    tol = 5e-3 if m <= 32 else 1e-2  # bf16 output rounding; prefill also rounds the dequantised weight
    assert rel_err(y, nvfp4_linear_ref(x, w, s, s2)) < tol


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m", [1, 5, 16, 32])
def test_bf16_linear_matches_reference(n, k, m):
    gen = torch.Generator(DEV).manual_seed(n + k * 7 + m)
    w = torch.randn(n, k, generator=gen, device=DEV).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    y = bf16_linear(x, w, out=poisoned(m, n))
    assert rel_err(y, bf16_linear_ref(x, w)) < 5e-3


def _check_batch_invariant(fn, k: int, gen: torch.Generator) -> None:
    x = torch.randn(40, k, generator=gen, device=DEV).to(torch.bfloat16)
    single = torch.cat([fn(x[r : r + 1]) for r in range(40)])  # every row launched alone
    for m in range(1, 33):
        for start in sorted({0, 1, 40 - m, (40 - m) // 2}):
            y = fn(x[start : start + m])
            assert torch.equal(y, single[start : start + m]), f"M={m} start={start}"
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(1)).to(DEV)
    assert torch.equal(fn(x[:32][perm]), single[:32][perm])


@pytest.mark.parametrize("splits", [1, 4])
def test_nvfp4_batch_invariant(splits):
    gen = torch.Generator(DEV).manual_seed(11 + splits)
    n, k = 64 * 3 + 5, 16 * 97
    packed = pack_nvfp4(*rand_nvfp4(n, k, gen), splits=splits)
    _check_batch_invariant(lambda x: nvfp4_linear(x, packed), k, gen)


def _all_codes_all_scales(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row: every finite e4m3 scale (both signs, zero) once, each block holding all 16 E2M1 codes."""
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = scales[~torch.isnan(scales.float())]  # [254]
    gen = torch.Generator().manual_seed(2)
    s = torch.stack([scales[torch.randperm(len(scales), generator=gen)] for _ in range(n)])  # [n, 254]
    block = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    w = block.repeat(n, len(scales))  # [n, 254 * 8]: codes 0..15 in every block
    return w.to(DEV), s.to(DEV), torch.tensor(1.0, device=DEV)


def test_dequant_exact_all_codes_all_scales():
    # The kernels build each weight as bf16(E2M1 * 2^-126) (a subnormal for +-0.5) times bf16(scale * 2^119):
    # HMUL2 must keep subnormal inputs and the product must be exact. One-hot x rows read W back exactly.
    w, s, s2 = _all_codes_all_scales(64 + 5)
    k = w.shape[1] * 2
    ref = nvfp4_dequantize(w, s, s2)  # [n, k] f32, exact e4m3 * E2M1 products
    packed = pack_nvfp4(w, s, s2, splits=1)
    eye = torch.eye(k, device=DEV, dtype=torch.bfloat16)
    got = torch.cat([nvfp4_linear(eye[i : i + 32], packed) for i in range(0, k, 32)])  # [k, n] = W^T
    assert torch.equal(got.float().t(), ref)
    assert torch.equal(nvfp4_linear(eye[:64], packed).float(), ref[:, :64].t())  # prefill dequant kernel


def test_launch_knobs_do_not_change_bits():
    gen = torch.Generator(DEV).manual_seed(17)
    n, k = 64 * 9 + 3, 16 * 131
    packed = pack_nvfp4(*rand_nvfp4(n, k, gen), splits=2)
    for m in (1, 9, 32):
        x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
        base = nvfp4_linear(x, packed)
        for stages in (2, 3, 5):
            for rgw in (1, 2, 4, 8):
                assert torch.equal(nvfp4_linear(x, packed, stages=stages, rgw=rgw), base), (m, stages, rgw)
        for tpw in (1, 2):  # warps of 1 or 2 m16 tiles instead of a whole row group
            for rgw in (1, 3):
                y = nvfp4_linear(x, packed, out=poisoned(m, n), rgw=rgw, tpw=tpw, cluster=False)
                assert torch.equal(y, base), (m, tpw, rgw)


def test_wave_fitted_tile_width_keeps_the_bits():
    """At the 27B's gate+up shape (4 slices) the library may narrow the register-direct tile where that
    fills whole waves (linear._rd_fit_waves): a launch choice, so the default launch gives the bits of
    the cross-CTA kernel + splitk_reduce at every M."""
    from lumo.kernels import linear

    gen = torch.Generator(DEV).manual_seed(29)
    n, k = 34816, 5120
    w, s, s2 = rand_nvfp4(n, k, gen)
    packed = pack_nvfp4(w, s, s2)
    assert packed.splits == 4
    for m in (1, 8, 16, 32):
        x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
        cross = nvfp4_linear(x, packed, rd=False, cluster=False)
        assert torch.equal(nvfp4_linear(x, packed, out=poisoned(m, n)), cross), m
        rd = linear.choose_rd(4, m)
        fitted = linear._rd_fit_waves(rd, packed.row_groups * linear.MT, -(-m // 8), 4, x.device)
        assert torch.equal(nvfp4_linear(x, packed, out=poisoned(m, n), rd=fitted), cross), (m, fitted)


@pytest.mark.parametrize("splits", [2, 5, 8, 16])
def test_split_k_variants_equal_cross_cta(splits):
    """The register-direct in-CTA split-K kernel (a warp per slice, slices summed in shared memory) and the
    cluster-reduced one (sm_90+: the S CTAs of a tile sum in distributed shared memory) give the bits of
    nvfp4_gemv + splitk_reduce for every tile width, ring depth, row-group count and tiles per warp."""
    gen = torch.Generator(DEV).manual_seed(23 + splits)
    n, k = 64 * 7 + 19, 16 * 16 * splits + 16 * 3  # a short last slice
    w, s, s2 = rand_nvfp4(n, k, gen)
    packed = pack_nvfp4(w, s, s2, splits=splits)
    clusters = torch.cuda.get_device_capability()[0] >= 9
    for m in (1, 2, 7, 8, 9, 17, 32):
        x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
        cross = nvfp4_linear(x, packed, rd=False, cluster=False)
        assert rel_err(cross, nvfp4_linear_ref(x, w, s, s2)) < 5e-3
        assert torch.equal(nvfp4_linear(x, packed, out=poisoned(m, n)), cross), m  # the default launch
        if splits == 8 and m > 16:  # the default is the register-direct kernel, in pairs of CTAs at NT 4
            from lumo.kernels import linear

            nt = -(-m // 8)
            rd = linear._rd_fit_waves(linear.choose_rd(8, m), packed.row_groups * linear.MT, nt, 8, x.device)
            cl = linear.RD_CLUSTERS.get((nt, *rd, 8), (1, 1))[0]
            assert rd == (2, 2) and cl == (2 if m > 24 else 1), (m, rd, cl)
            fits = linear._rd_cluster_fits(nt, 2, 2, 8, cl, packed.row_groups, 0, False, x.device)
            assert fits == (cl == 1 or clusters), m
        if clusters:
            for st, rgw, tpw in ((None, None, None), (2, 1, None), (3, 8, None), (3, 2, 1), (None, 4, 2)):
                y = nvfp4_linear(x, packed, out=poisoned(m, n), stages=st, rgw=rgw, tpw=tpw, cluster=True)
                assert torch.equal(y, cross), (m, st, rgw, tpw)
        rds = ((1, 1), (1, 2), (1, 4), (2, 3), (4, 2), (2, 6)) if m <= 8 else ((1, 2), (2, 2), (4, 2))
        for rd in rds:  # register-direct: any tile width and prefetch depth that fits shared memory
            if splits * rd[0] * -(-m // 8) * 512 > smem_limit(x.device):
                continue
            y = nvfp4_linear(x, packed, out=poisoned(m, n), rd=rd)
            assert torch.equal(y, cross), (m, rd)
            # The slices spread over a cluster of CTAs (sm_90+), summed through distributed shared memory;
            # rdcl = 1: one CTA even where RD_CLUSTERS names a cluster (a device that refuses it).
            for rdcl in [c for c in (1, 2, 4, 8) if c == 1 or clusters and splits % c == 0]:
                y = nvfp4_linear(x, packed, out=poisoned(m, n), rd=rd, rdcl=rdcl)
                assert torch.equal(y, cross), (m, rd, rdcl)
        # Slice activations in shared memory (nvfp4_gemv_sx): warps x tile width x prefetch, idle warps in
        # the last CTA (7 row groups), cluster-reduced and through the partials.
        for sx in ((8, 2, 3), (4, 1, 1), (2, 2, 2), (4, 4, 2), (12, 1, 4)):
            for cl in (True, False) if clusters else (False,):
                y = nvfp4_linear(x, packed, out=poisoned(m, n), sx=sx, cluster=cl)
                assert torch.equal(y, cross), (m, sx, cl)
        # Every chunk asked of L2 before the wait (l2pf): the same bits.
        for kw in (dict(rd=rds[-1]), dict(sx=(8, 2, 3))):
            y = nvfp4_linear(x, packed, out=poisoned(m, n), l2pf=1 << 30, **kw)
            assert torch.equal(y, cross), (m, kw)


@pytest.mark.parametrize("splits", [2, 8, 16])
def test_staged_weights_keep_the_bits(monkeypatch, splits):
    """nvfp4_linear(stage=True): the register-direct kernel with every warp's slice copied into shared
    memory before its wait (linear.cu STG) gives the bits of the usual launch for tile widths 1 / 2 / 4,
    prefetch depths 2 / 3, clusters of 2 / 4 CTAs and M 1..32 (a partial row group; with 16 slices a short
    last slice and empty ones); where the copy exceeds shared memory or one wave cannot hold the grid the
    usual kernel runs, the same bits."""
    from lumo.kernels import linear

    gen = torch.Generator(DEV).manual_seed(31 + splits)
    n, k = 64 * 5 + 27, 16 * 8 * splits + 16 * 5
    w, s, s2 = rand_nvfp4(n, k, gen)
    packed = pack_nvfp4(w, s, s2, splits=splits)
    clusters = torch.cuda.get_device_capability()[0] >= 9
    staged = stage_spy(monkeypatch)
    for m in (1, 3, 9, 17, 32):
        x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
        want = nvfp4_linear(x, packed)
        assert rel_err(want, nvfp4_linear_ref(x, w, s, s2)) < 5e-3
        for rd in (None, (1, 2), (2, 2), (2, 3), (4, 2)):
            for rdcl in [None] + [c for c in (2, 4) if clusters and splits % c == 0 and rd is not None]:
                staged.clear()
                y = nvfp4_linear(x, packed, out=poisoned(m, n), rd=rd, rdcl=rdcl, stage=True)
                assert torch.equal(y, want), (m, rd, rdcl)
                if rd is None and linear.choose_rd(splits, m) is None:
                    assert staged == [], m  # the default is a ring kernel there: nothing to stage
                    continue
                # A grid of ~20 CTAs: one wave holds it wherever a CTA's copy fits shared memory.
                assert len(staged) == 1 and staged[0][0] == (staged[0][1] <= smem_limit(x.device)), (m, rd)
                assert rd is not None or staged[0][0], m  # the default launch stages here
    x = x[:1]
    want = nvfp4_linear(x, packed)
    monkeypatch.setattr(linear, "sm_count", lambda device: 0)  # no CTA slot: never one wave
    staged.clear()
    y = nvfp4_linear(x, packed, out=poisoned(1, n), stage=True)
    assert staged[0][0] is False and torch.equal(y, want)


@pytest.mark.parametrize("rd", [True, False], ids=["one-warp", "bf16_gemv"])
def test_bf16_batch_invariant(rd):
    gen = torch.Generator(DEV).manual_seed(5)
    n, k = 150, 16 * 41
    w = torch.randn(n, k, generator=gen, device=DEV).to(torch.bfloat16)
    _check_batch_invariant(lambda x: bf16_linear(x, w, rd=rd), k, gen)


# The GDN b/a (16 slices of 5 chunks), odd shapes with a short last chunk (150 x 656: 11 chunks in 2
# slices; 48 x 592: 10 in 2), one slice (100 x 80; 8 x 144: half a tile), 16 row groups in 4 slices
# (1000 x 1072), three empty trailing slices (96 x 4144: 65 chunks in 16 slices of 5), an N that is not a
# multiple of 32 with 4 slices (323 x 2064) and one 27B-wide shape (2000 x 5120, 2 slices).
BF16_SHAPES = [(96, 5120), (150, 16 * 41), (48, 16 * 37), (100, 80), (8, 16 * 9), (1000, 16 * 67)]
BF16_SHAPES += [(96, 16 * 259), (64 * 5 + 3, 16 * 129), (2000, 5120)]


@pytest.mark.parametrize("n,k", BF16_SHAPES, ids=[f"N{n}-K{k}" for n, k in BF16_SHAPES])
def test_bf16_kernels_and_launch_variants_give_the_same_bits(n, k):
    """bf16_gemv (KW warps per m16 tiles and slice, operands straight into registers) in every launch
    variant (m16 tiles per warp, weight and activation chunks in flight) and the one-warp kernel
    bf16_gemv_rd give the same bits for every M, and match the fp32 reference; the slices' partials go
    through the workspace (NaN-poisoned: every element they sum is written)."""
    gen = torch.Generator(DEV).manual_seed(3 * n + k)
    w = torch.randn(n, k, generator=gen, device=DEV).to(torch.bfloat16)
    splits = _bf16_splits(n, k)
    variants = [dict(rd=True), dict(rd=False), dict(reg=(1, 2, 2)), dict(reg=(1, 4, 1)), dict(reg=(2, 3, 3))]
    variants += [dict(reg=(2, 2, 1)), dict(reg=(1, 3, 1))]
    for m in (1, 2, 7, 8, 9, 16, 17, 24, 25, 32):
        x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
        ref = bf16_linear(x, w)
        assert rel_err(ref, bf16_linear_ref(x, w)) < 5e-3, m
        for kw in variants:
            ws = torch.full((max(splits, 2), 32, n), float("nan"), device=DEV)
            y = bf16_linear(x, w, out=poisoned(m, n), workspace=ws, **kw)
            assert torch.equal(y, ref), (m, kw)


def test_fused_shards_keep_their_scales():
    gen = torch.Generator(DEV).manual_seed(3)
    k = 16 * 21
    shards = [rand_nvfp4(n, k, gen) for n in (48, 72, 8, 100)]
    packed = pack_fused(shards)
    x = torch.randn(7, k, generator=gen, device=DEV).to(torch.bfloat16)
    outs = split_fused(nvfp4_linear(x, packed), packed)
    for o, sh in zip(outs, shards, strict=True):
        assert rel_err(o, nvfp4_linear_ref(x, *sh)) < 5e-3


@pytest.mark.parametrize("i,k,splits", [(136, 16 * 45, 4), (100, 16 * 37, 3), (8 * 33, 16 * 16, 1)])
def test_glu_fused_swiglu_equals_gemv_then_silu_mul(monkeypatch, i, k, splits):
    """An MLP's [gate | up] packed for the fused SwiGLU (pack_fused(glu=True)) gives, at every M <= 32 and
    through every kernel (the register-direct one applies silu(gate) * up in its epilogue, the others
    write the interleaved rows for silu_mul), the bits of the plain fused GEMV followed by torch's silu
    then mul (silu_mul's bits: test_norms_gpu); the prefill path (M > 32) matches the fp32 reference.
    I = 100 is not a multiple of 8 (padded rows)."""
    from lumo.kernels.norms import silu_mul_ref  # torch's F.silu then mul: silu_mul's bits, any I

    gen = torch.Generator(DEV).manual_seed(i + k)
    gate, up = rand_nvfp4(i, k, gen), rand_nvfp4(i, k, gen)
    plain = pack_fused([gate, up], splits=splits)
    fused = pack_fused([gate, up], splits=splits, glu=True)
    assert fused.out_features == i and fused.splits == splits
    knobs = [{}, dict(rd=False, cluster=False), dict(rd=(1, 2)), dict(rd=(4, 2)), dict(sx=(8, 2, 3))]
    knobs += [dict(stage=True), dict(rd=(2, 2), stage=True)]  # the weights staged in shared memory
    if torch.cuda.get_device_capability()[0] >= 9:
        knobs += [dict(rd=False, cluster=True)] + ([dict(rd=(1, 2), rdcl=2)] if splits % 2 == 0 else [])
    staged = stage_spy(monkeypatch)
    for m in (1, 2, 7, 9, 17, 32):
        x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
        want = silu_mul_ref(nvfp4_linear(x, plain))
        for kw in knobs:
            assert torch.equal(nvfp4_linear(x, fused, out=poisoned(m, i), **kw), want), (m, kw)
    assert staged and all(ok for ok, _ in staged)  # the stage knobs ran the staged build (rd=(2, 2) always)
    x = torch.randn(45, k, generator=gen, device=DEV).to(torch.bfloat16)
    g, u = nvfp4_linear_ref(x, *gate), nvfp4_linear_ref(x, *up)
    assert rel_err(nvfp4_linear(x, fused), torch.nn.functional.silu(g) * u) < 1e-2


def test_prefill_in_several_dequant_tiles(monkeypatch):
    """The large-M path with a workspace of one or two row groups: every tile's GEMM writes its column
    slice of the output in place (strided; a NaN-poisoned output shows any slice left out), plain and
    fused-SwiGLU weights, against the fp32 reference."""
    import lumo.kernels.linear as L

    gen = torch.Generator(DEV).manual_seed(7)
    n, k, i = 64 * 5 + 3, 16 * 33, 100
    w = rand_nvfp4(n, k, gen)
    gate, up = rand_nvfp4(i, k, gen), rand_nvfp4(i, k, gen)
    packed, fused = pack_nvfp4(*w), pack_fused([gate, up], glu=True)
    x = torch.randn(70, k, generator=gen, device=DEV).to(torch.bfloat16)
    ref = nvfp4_linear_ref(x, *w)
    ref_glu = torch.nn.functional.silu(nvfp4_linear_ref(x, *gate)) * nvfp4_linear_ref(x, *up)
    for groups in (1, 2, 64):  # 64: the whole weight in one tile
        monkeypatch.setattr(L, "PREFILL_WORKSPACE", groups * 64 * k * 2)
        assert rel_err(nvfp4_linear(x, packed, out=poisoned(70, n)), ref) < 1e-2, groups
        rows = poisoned(70, fused.n)  # the tiles' GEMMs write the interleaved gate / up rows here
        assert rel_err(nvfp4_linear(x, fused, out=poisoned(70, i), rows=rows), ref_glu) < 1e-2, groups


CONV_CASES = [(64 * 5 + 3, 16 * 33, 64 * 5 + 3, 4, 4), (300, 16 * 41, 211, 4, 8), (77, 16 * 9, 40, 3, 1)]


@pytest.mark.parametrize(
    "n,k,c,taps,splits", CONV_CASES, ids=[f"N{n}-K{k}-C{c}-K{t}" for n, k, c, t, _ in CONV_CASES]
)
def test_conv_fused_into_the_gemv_equals_gemv_then_conv_decode(monkeypatch, n, k, c, taps, splits):
    """nvfp4_linear(conv=...) at M = 1 (the GDN decode: q/k/v/z, then the conv over its first C columns):
    through every kernel (the register-direct one runs conv_decode's step in its epilogue, the others are
    followed by conv_decode) the projection, the conv output and the updated state are bitwise the GEMV
    followed by conv_decode, over several steps (the state carries on). C not a multiple of 16 and C = N;
    the conv output also against the fp32 conv reference. Where the register-direct kernel runs (the
    default at M = 1 and the rd= knobs) the launcher must not fall back to conv_decode."""
    from lumo.kernels import linear
    from lumo.kernels.conv import conv_decode, conv_gather_ref, conv_pred_chain

    gen = torch.Generator(DEV).manual_seed(n + k + c)
    packed = pack_nvfp4(*rand_nvfp4(n, k, gen), splits=splits)
    cw = (torch.randn(c, taps, generator=gen, device=DEV) * 0.5).to(torch.bfloat16)
    state0 = torch.randn(c, taps - 1, generator=gen, device=DEV).to(torch.bfloat16)
    knobs = [{}, dict(rd=(1, 2)), dict(rd=(2, 3)), dict(rd=False, cluster=False), dict(sx=(8, 2, 3))]
    knobs += [dict(stage=True), dict(rd=(2, 3), stage=True)]  # the weights staged in shared memory
    if torch.cuda.get_device_capability()[0] >= 9 and splits % 2 == 0:
        knobs += [dict(rd=(1, 2), rdcl=2), dict(rd=False, cluster=True), dict(rd=(1, 2), rdcl=2, stage=True)]
    xs = [torch.randn(1, k, generator=gen, device=DEV).to(torch.bfloat16) for _ in range(3)]
    want_state = state0.clone()
    want = []
    for x in xs:
        y = nvfp4_linear(x, packed)
        ref = conv_gather_ref(y[:, :c], cw, want_state, conv_pred_chain(1, taps))
        yc = conv_decode(y[:, :c], cw, want_state)
        assert rel_err(yc, ref.float()) < 1e-2
        want.append((y, yc))

    def unfused(*a, **k):
        raise AssertionError("the register-direct kernel fell back to conv_decode")

    staged = stage_spy(monkeypatch)
    for kw in knobs:
        fused = kw.get("rd") is not False and "sx" not in kw  # the default at M = 1 is register-direct
        monkeypatch.setattr(linear, "conv_decode", unfused if fused else conv_decode)
        state = state0.clone()
        for x, (y, yc) in zip(xs, want, strict=True):
            out, yc_out = poisoned(1, n), poisoned(1, c)
            got = nvfp4_linear(x, packed, out=out, conv=(cw, state, yc_out), **kw)
            assert got is out and torch.equal(out, y) and torch.equal(yc_out, yc), kw
        assert torch.equal(state, want_state), kw
    assert len(staged) == 3 * sum(bool(kw.get("stage")) for kw in knobs) and all(ok for ok, _ in staged)
    monkeypatch.setattr(linear, "conv_decode", conv_decode)
    with pytest.raises(ValueError, match="one-token"):
        nvfp4_linear(torch.cat(xs[:2]), packed, conv=(cw, state0.clone(), poisoned(1, c)))
    with pytest.raises(ValueError, match="channels"):
        big = torch.zeros(n + 1, taps, dtype=torch.bfloat16, device=DEV)
        nvfp4_linear(
            xs[0],
            packed,
            conv=(big, torch.zeros(n + 1, taps - 1, dtype=torch.bfloat16, device=DEV), poisoned(1, n + 1)),
        )


@pytest.mark.parametrize("m", [1, 32])
def test_graph_replay_equals_eager(m):
    gen = torch.Generator(DEV).manual_seed(m)
    n, k = 500, 16 * 65
    w, s, s2 = rand_nvfp4(n, k, gen)
    packed = pack_nvfp4(w, s, s2, splits=2)
    wb = torch.randn(n, k, generator=gen, device=DEV).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    y, yb, yc, yg = poisoned(m, n), poisoned(m, n), poisoned(m, n), poisoned(m, n)
    nvfp4_linear(x, packed, out=y)  # compile and load outside the capture
    nvfp4_linear(x, packed, out=yc, rd=False, cluster=False)
    bf16_linear(x, wb, out=yb, workspace=torch.empty(4, 32, n, device=DEV))
    bf16_linear(x, wb, out=yg, workspace=torch.empty(4, 32, n, device=DEV), rd=False)
    ws, wsg = torch.empty(8, 32, n, device=DEV), torch.empty(8, 32, n, device=DEV)
    fresh = pack_nvfp4(w, s, s2, splits=2)  # the cross-CTA kernel makes its partial buffer in the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nvfp4_linear(x, packed, out=y)
        nvfp4_linear(x, fresh, out=yc, rd=False, cluster=False)
        bf16_linear(x, wb, out=yb, workspace=ws)
        bf16_linear(x, wb, out=yg, workspace=wsg, rd=False)
    assert fresh.partial is not None
    for _ in range(2):
        x.copy_(torch.randn(m, k, generator=gen, device=DEV))
        for t in (y, yb, yc, yg):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, nvfp4_linear(x, packed))
        assert torch.equal(yc, y)
        assert torch.equal(yb, bf16_linear(x, wb))
        assert torch.equal(yg, yb)


def test_cluster_fallback_when_the_device_cannot_schedule_it(monkeypatch):
    """Where the driver says S-CTA clusters do not fit (max_cluster_size < S), M = 32 runs the cross-CTA
    kernel: same bits, and the weight's partial buffer is made then, for 32 rows."""
    from lumo.kernels import linear
    from lumo.kernels.compile import Kernel

    gen = torch.Generator(DEV).manual_seed(29)
    n, k = 64 * 5 + 7, 16 * 16 * 16
    weight = rand_nvfp4(n, k, gen)
    x = torch.randn(32, k, generator=gen, device=DEV).to(torch.bfloat16)
    want = nvfp4_linear(x, pack_nvfp4(*weight, splits=16), rd=False, cluster=False)
    packed = pack_nvfp4(*weight, splits=16)
    assert torch.equal(nvfp4_linear(x[:1], packed), want[:1])  # M = 1: register-direct, no partials
    assert packed.partial is None
    monkeypatch.setattr(Kernel, "max_cluster_size", lambda self, grid, block, shmem: 8)
    linear._sx_fits.cache_clear()  # its answers asked the real driver (and this test's must not stay)
    try:
        assert torch.equal(nvfp4_linear(x, packed, out=poisoned(32, n)), want)
        assert packed.partial.shape == (16, 32, n)
    finally:
        linear._sx_fits.cache_clear()


def test_timeline_trace_records_every_cta_and_keeps_the_bits():
    """trace.set_trace (bench/trace_step.py): the traced nvfp4_gemv_rd build appends one record per CTA
    (stamps in order: start <= after the wait <= after the main loop <= end; kind 0; the grid size; the
    weight pointer) and gives the plain build's bits; a full buffer counts on without writing past its end."""
    from lumo.kernels import linear
    from lumo.kernels.trace import set_trace

    with pytest.raises(ValueError, match="trace buffer"):
        set_trace(torch.zeros(4, 7, dtype=torch.int64, device=DEV))
    gen = torch.Generator(DEV).manual_seed(31)
    n, k = 64 * 5 + 3, 16 * 16 * 4
    packed = pack_nvfp4(*rand_nvfp4(n, k, gen), splits=4)
    x = torch.randn(1, k, generator=gen, device=DEV).to(torch.bfloat16)
    want = nvfp4_linear(x, packed, rd=(1, 2))
    buf = torch.zeros(1 + 64, 8, dtype=torch.int64, device=DEV)
    try:
        set_trace(buf[:21])  # room for 20 records
        y = nvfp4_linear(x, packed, out=poisoned(1, n), rd=(1, 2))
        torch.cuda.synchronize()
        assert torch.equal(y, want)
        grid, _, _ = linear._rd_shape(packed.row_groups, 1, 1, packed.splits, 1)  # one m16 tile per CTA
        ctas = grid[0] * grid[1]
        assert buf[0, 0].item() == ctas > 20
        rec = buf[1:21].cpu()
        assert (rec[:, 0] > 0).all()  # stamped
        assert (
            (rec[:, 0] <= rec[:, 1]).all()
            and (rec[:, 1] <= rec[:, 2]).all()
            and (rec[:, 2] <= rec[:, 3]).all()
        )
        assert (rec[:, 6] & 0xFFFFFFFF == ctas).all() and (rec[:, 7] == packed.qw.data_ptr()).all()
        assert (rec[:, 4] == 0).all() and (rec[:, 5] == 0).all()  # no fifth stamp; kind 0 (the GEMV)
        assert (buf[21:] == 0).all()  # nothing written past the 20 records the kernel was given
    finally:
        set_trace(None)
    assert torch.equal(nvfp4_linear(x, packed, rd=(1, 2)), want)


def test_row_kernel_traces_keep_the_bits():
    """The traced rmsnorm1p_residual (kind 2) and gdn_recurrent_norm (kind 1) builds append one record per CTA
    with ordered stamps (GDN: start <= wait <= operands <= state stored <= end), their norm weight / state
    pointer as the key, and give the plain builds' bits."""
    from lumo.kernels.gdn import gdn_decode_norm
    from lumo.kernels.norms import rmsnorm1p
    from lumo.kernels.trace import set_trace

    gen = torch.Generator(DEV).manual_seed(5)
    h = torch.randn(3, 5120, generator=gen, device=DEV).to(torch.bfloat16)
    d = torch.randn(3, 5120, generator=gen, device=DEV).to(torch.bfloat16)
    w = torch.randn(5120, generator=gen, device=DEV).to(torch.bfloat16)
    nv, dk, dv = 6, 64, 64
    g_in = dict(
        mixed=torch.randn(1, 2 * 2 * dk + nv * dv, generator=gen, device=DEV).to(torch.bfloat16),
        a=torch.randn(1, nv, generator=gen, device=DEV).to(torch.bfloat16),
        b=torch.randn(1, nv, generator=gen, device=DEV).to(torch.bfloat16),
        A_log=torch.rand(nv, generator=gen, device=DEV),
        dt_bias=torch.randn(nv, generator=gen, device=DEV),
        z=torch.randn(1, nv, dv, generator=gen, device=DEV).to(torch.bfloat16),
        norm_w=torch.randn(dv, generator=gen, device=DEV).to(torch.bfloat16),
        eps=1e-6,
    )
    state0 = torch.randn(nv, dk, dv, generator=gen, device=DEV)

    def run() -> tuple[torch.Tensor, ...]:
        hh, st = h.clone(), state0.clone()
        y = rmsnorm1p(hh, w, 1e-6, delta=d)
        return hh, y, gdn_decode_norm(**g_in, state=st), st

    want = run()
    buf = torch.zeros(1 + 64, 8, dtype=torch.int64, device=DEV)
    try:
        set_trace(buf)
        got = run()
        torch.cuda.synchronize()
    finally:
        set_trace(None)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    n = int(buf[0, 0])
    assert n == 3 + nv  # a CTA per row, a CTA per value head
    rec = buf[1 : 1 + n].cpu()
    assert (rec[:, 0] > 0).all() and (rec[:, 0] <= rec[:, 1]).all() and (rec[:, 1] <= rec[:, 2]).all()
    assert (rec[:, 2] <= rec[:, 3]).all()
    norm, gdn = rec[rec[:, 5] == 2], rec[rec[:, 5] == 1]
    assert len(norm) == 3 and len(gdn) == nv
    assert (norm[:, 7] == w.data_ptr()).all() and (norm[:, 6] & 0xFFFFFFFF == 3).all()
    assert (
        (gdn[:, 2] <= gdn[:, 4]).all()
        and (gdn[:, 4] <= gdn[:, 3]).all()
        and (gdn[:, 6] & 0xFFFFFFFF == nv).all()
    )
    assert (norm[:, 4] == 0).all()
