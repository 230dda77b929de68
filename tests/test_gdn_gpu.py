"""GPU: the GDN recurrence kernel vs the fp32 references, T-invariance (replay == decode chain), modes."""

from __future__ import annotations

import pytest
import torch

from lumo.kernels.gdn import (
    fused_norm_ok,
    gdn_decode,
    gdn_decode_norm,
    gdn_decode_ref,
    gdn_prefill,
    gdn_prefill_ref,
)
from lumo.kernels.norms import gated_rmsnorm, gated_rmsnorm_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"

# (nk, nv, dk, dv): 27B, embedded model, odd ones (DVT 8 with 2 rows per lane; 12 rows per lane, r = 3).
SHAPES = [(16, 48, 128, 128), (2, 4, 64, 64), (2, 6, 32, 24), (3, 9, 96, 48)]
IDS = [f"nk{nk}-nv{nv}-dk{dk}-dv{dv}" for nk, nv, dk, dv in SHAPES]


def make(T: int, nk: int, nv: int, dk: int, dv: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    a = torch.randn(T, nv, generator=gen) * 2
    if T:
        a[0, 0] = 25.0  # softplus identity branch
    inp = dict(
        mixed=torch.randn(T, C, generator=gen).to(torch.bfloat16),
        a=a.to(torch.bfloat16),
        b=(torch.randn(T, nv, generator=gen) * 2).to(torch.bfloat16),
        A_log=torch.rand(nv, generator=gen) * 2 - 1,
        dt_bias=torch.randn(nv, generator=gen),
        state=torch.randn(nv, dk, dv, generator=gen),
    )
    return {k: v.to(DEV) for k, v in inp.items()}


def cpu(inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in inp.items()}


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    assert torch.isfinite(x).all(), "non-finite output (unwritten element?)"
    return ((x - ref).norm() / ref.norm()).item()


def poisoned(T: int, nv: int, dv: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((T, nv, dv), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("nk,nv,dk,dv", SHAPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["of32", "obf16"])
def test_decode_matches_reference(nk, nv, dk, dv, dtype):
    inp = make(1, nk, nv, dk, dv, seed=nv + dk)
    o_ref, s_ref = gdn_decode_ref(**cpu(inp))
    state = inp["state"].clone()
    o = gdn_decode(**{**inp, "state": state}, out=poisoned(1, nv, dv, dtype))
    assert rel(o, o_ref) < (1e-5 if dtype == torch.float32 else 5e-3)
    assert rel(state, s_ref) < 1e-5


@pytest.mark.parametrize("nk,nv,dk,dv", SHAPES, ids=IDS)
@pytest.mark.parametrize("hid", [16 * 40, 16 * 160, 16 * 321], ids=["S2", "S8", "S16"])
def test_decode_sums_the_ba_split_k_partials_as_splitk_reduce(nk, nv, dk, dv, hid):
    """gdn_decode(ba_splitk=...): the b/a projection's split-K partials of the runner's decode step
    (bf16_linear_partials of a [b | a] weight) summed in the kernel give bitwise the outputs and state of
    bf16_linear's reduced b / a (splitk_reduce) fed as usual; and the partials' slice-order sum in bf16 is
    bf16_linear's output. K sets the slice count (2, 8, 16)."""
    from lumo.kernels.linear import _bf16_splits, bf16_linear, bf16_linear_partials

    inp = make(1, nk, nv, dk, dv, seed=3 * nv + dk)
    gen = torch.Generator(DEV).manual_seed(nv + hid)
    w = (torch.randn(2 * nv, hid, generator=gen, device=DEV) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, hid, generator=gen, device=DEV).to(torch.bfloat16)
    ws = torch.empty(16, 32, 2 * nv, device=DEV)
    ba = bf16_linear(x, w, workspace=torch.empty_like(ws))
    part = bf16_linear_partials(x, w, ws)
    assert part is not None and part.shape == (_bf16_splits(2 * nv, hid), 1, 2 * nv)
    assert part.shape[0] == {16 * 40: 2, 16 * 160: 8, 16 * 321: 16}[hid]
    total = part[0].clone()
    for s in range(1, part.shape[0]):
        total += part[s]
    assert torch.equal(total.to(torch.bfloat16), ba)
    b, a = ba[:, :nv], ba[:, nv:]
    want_state, state = inp["state"].clone(), inp["state"].clone()
    want = gdn_decode(**{**inp, "a": a, "b": b, "state": want_state}, out=poisoned(1, nv, dv, torch.bfloat16))
    junk = torch.full_like(a, float("nan"))  # a / b are not read
    got = gdn_decode(
        **{**inp, "a": junk, "b": junk, "state": state},
        out=poisoned(1, nv, dv, torch.bfloat16),
        ba_splitk=(part[:, 0, nv:], part[:, 0, :nv]),
    )
    assert torch.equal(got, want) and torch.equal(state, want_state)
    with pytest.raises(ValueError, match="one-token"):
        two = make(2, nk, nv, dk, dv, seed=1)
        gdn_decode(**two, ba_splitk=(part[:, 0, nv:], part[:, 0, :nv]))


# Head shapes of the fused recurrence + norm (dv % 32 == 0): 27B, embedded model, 6 and 2 dv tiles a head.
NORM_SHAPES = [(16, 48, 128, 128), (2, 4, 64, 64), (3, 9, 64, 96), (1, 2, 32, 32)]


@pytest.mark.parametrize(
    "nk,nv,dk,dv", NORM_SHAPES, ids=[f"nk{a}-nv{b}-dk{c}-dv{d}" for a, b, c, d in NORM_SHAPES]
)
@pytest.mark.parametrize("param_bf16", [False, True], ids=["pf32", "pbf16"])
@pytest.mark.parametrize("splitk", [False, True], ids=["ba", "ba_splitk"])
def test_decode_norm_equals_decode_then_gated_norm(nk, nv, dk, dv, param_bf16, splitk):
    """gdn_decode_norm (one launch) gives bitwise gdn_decode's state and gated_rmsnorm(gdn_decode's bf16 o)'s
    y, z read from a view into a wider projection row as the runner's; both within bf16 tolerance of the fp32
    references. With ba_splitk the b/a split-K partials are summed in the kernel as gdn_decode does."""
    from lumo.kernels.linear import bf16_linear, bf16_linear_partials

    assert fused_norm_ok(dk, dv)
    inp = make(1, nk, nv, dk, dv, seed=5 * nv + dv)
    if param_bf16:
        inp["A_log"], inp["dt_bias"] = inp["A_log"].to(torch.bfloat16), inp["dt_bias"].to(torch.bfloat16)
    gen = torch.Generator(DEV).manual_seed(dv + nv)
    proj = torch.randn(1, 3 * nv * dv, generator=gen, device=DEV).to(torch.bfloat16)
    z = proj[:, nv * dv : 2 * nv * dv].view(1, nv, dv)
    w = (1 + 0.2 * torch.randn(dv, generator=gen, device=DEV)).to(torch.bfloat16)
    eps = 1e-6
    ba_splitk = None
    if splitk:
        hid = 16 * 321
        wba = (torch.randn(2 * nv, hid, generator=gen, device=DEV) * 0.02).to(torch.bfloat16)
        x = torch.randn(1, hid, generator=gen, device=DEV).to(torch.bfloat16)
        ba = bf16_linear(x, wba, workspace=torch.empty(16, 32, 2 * nv, device=DEV))
        part = bf16_linear_partials(x, wba, torch.empty(16, 32, 2 * nv, device=DEV))
        inp["b"], inp["a"] = ba[:, :nv].contiguous(), ba[:, nv:].contiguous()
        ba_splitk = (part[:, 0, nv:], part[:, 0, :nv])
    want_state, state = inp["state"].clone(), inp["state"].clone()
    o = gdn_decode(**{**inp, "state": want_state}, out=poisoned(1, nv, dv, torch.bfloat16))
    want = gated_rmsnorm(o, z, w, eps)
    fed = dict(inp)
    if splitk:  # a / b are not read
        fed["a"] = fed["b"] = torch.full_like(inp["a"], float("nan"))
    out = torch.full((1, nv * dv), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = gdn_decode_norm(**{**fed, "state": state}, z=z, norm_w=w, eps=eps, out=out, ba_splitk=ba_splitk)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want) and torch.equal(state, want_state)
    o_ref, s_ref = gdn_decode_ref(**cpu(inp))
    y_ref = gated_rmsnorm_ref(o_ref, z.cpu(), w.cpu(), eps)
    assert rel(got, y_ref) < 1e-2 and rel(state, s_ref) < 1e-5


def test_decode_norm_refusals():
    inp = make(2, 2, 4, 64, 64, seed=1)
    z = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="one token"):
        gdn_decode_norm(**inp, z=z, norm_w=w, eps=1e-6)
    one = make(1, 2, 6, 32, 24, seed=1)
    with pytest.raises(ValueError, match="dv % 32"):
        gdn_decode_norm(
            **one, z=torch.zeros(1, 6, 24, dtype=torch.bfloat16, device=DEV), norm_w=w[:24], eps=1e-6
        )
    one = make(1, 2, 4, 64, 64, seed=1)
    with pytest.raises(ValueError, match="z must be"):
        gdn_decode_norm(**one, z=z.float(), norm_w=w, eps=1e-6)


@pytest.mark.parametrize("nk,nv,dk,dv", SHAPES, ids=IDS)
@pytest.mark.parametrize("T", [2, 65, 333])
def test_prefill_matches_chunked_reference(nk, nv, dk, dv, T):
    inp = make(T, nk, nv, dk, dv, seed=T * 7 + nv)
    o_ref, s_ref = gdn_prefill_ref(**cpu(inp))
    state = inp["state"].clone()
    o = gdn_prefill(**{**inp, "state": state}, out=poisoned(T, nv, dv, torch.float32))
    assert rel(o, o_ref) < 1e-4 and rel(state, s_ref) < 1e-4


# (head shape, walk kernel): every kernel at each of SHAPES it takes; (2, 4, 64, 40) adds the tensor-core walk
# with one n8 tile (DVS = 8), in three passes, and the CUDA-core walk.
CHUNK_CASES = [
    (shape, scan) for shape in SHAPES for scan in ("tc", "tc1", "fma") if scan == "fma" or shape[2] % 64 == 0
]
CHUNK_CASES += [((2, 4, 64, 40), "tc"), ((2, 4, 64, 40), "fma")]
CHUNK_IDS = ["nk{}-nv{}-dk{}-dv{}-{}".format(*shape, scan) for shape, scan in CHUNK_CASES]
TOL = {
    "tc": 1e-4,
    "tc1": 5e-3,
    "fma": 1e-4,
}  # relative error bounds; "tc1": one tf32 pass (~2^-11 per operand)


@pytest.mark.parametrize("shape,scan", CHUNK_CASES, ids=CHUNK_IDS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 333])
def test_chunked_prefill_matches_reference_and_sequential(shape, scan, T):
    """gdn_chunk.cu (chunked=True) against the fp32 chunked reference and the sequential kernel; state_out
    leaves `state` untouched; a ragged last chunk, one token and whole chunks."""
    nk, nv, dk, dv = shape
    tol = TOL[scan]
    inp = make(T, nk, nv, dk, dv, seed=T * 3 + nv)
    o_ref, s_ref = gdn_prefill_ref(**cpu(inp))
    s_seq = inp["state"].clone()
    o_seq = gdn_prefill(**{**inp, "state": s_seq}, out_dtype=torch.float32, chunked=False)
    state0 = inp["state"].clone()
    s_out = torch.full_like(state0, float("nan"))
    o = gdn_prefill(**inp, out=poisoned(T, nv, dv, torch.float32), state_out=s_out, chunked=True, scan=scan)
    assert torch.equal(inp["state"], state0)
    assert rel(o, o_ref) < tol and rel(s_out, s_ref) < tol
    assert rel(o, o_seq) < tol and rel(s_out, s_seq) < tol
    ob = gdn_prefill(
        **inp, out=poisoned(T, nv, dv, torch.bfloat16), chunked=True, scan=scan
    )  # in place, bf16 o
    assert rel(ob, o_ref) < 5e-3 + tol and rel(inp["state"], s_ref) < tol


@pytest.mark.parametrize("tile", [8, 16, 32])
@pytest.mark.parametrize("shape", [(16, 48, 128, 128), (2, 4, 64, 64)], ids=["27b", "dk64"])
def test_chunked_tc_tile_widths(monkeypatch, shape, tile):
    """gdn_chunk_scan_tc at each state tile width (CHUNK_TC_DVS: 16 columns by default, 8 where dv needs
    it; 32 measured slower) against the fp32 reference."""
    import lumo.kernels.gdn as G

    monkeypatch.setattr(G, "CHUNK_TC_DVS", tile)
    nk, nv, dk, dv = shape
    inp = make(200, nk, nv, dk, dv, seed=tile)
    o_ref, s_ref = gdn_prefill_ref(**cpu(inp))
    o = gdn_prefill(**inp, out=poisoned(200, nv, dv, torch.float32), chunked=True, scan="tc")
    assert rel(o, o_ref) < 1e-4 and rel(inp["state"], s_ref) < 1e-4


def test_chunked_prefill_default_walk_and_refusals():
    """The tensor-core walk is the default where dk % 64 == 0 (the same bits as scan="tc"); unknown walks
    and a tensor-core walk at dk % 64 != 0 are refused."""
    inp = make(130, 2, 4, 64, 40, seed=3)
    o_dflt = gdn_prefill(**{**inp, "state": inp["state"].clone()}, out_dtype=torch.float32)
    o_tc = gdn_prefill(**{**inp, "state": inp["state"].clone()}, out_dtype=torch.float32, scan="tc")
    o_fma = gdn_prefill(**{**inp, "state": inp["state"].clone()}, out_dtype=torch.float32, scan="fma")
    assert torch.equal(o_dflt, o_tc) and not torch.equal(o_tc, o_fma)
    with pytest.raises(ValueError, match="scan"):
        gdn_prefill(**inp, chunked=True, scan="wgmma")
    small = make(130, 2, 6, 32, 24, seed=3)
    with pytest.raises(ValueError, match="dk % 64"):
        gdn_prefill(**small, chunked=True, scan="tc")


@pytest.mark.parametrize("shape,scan", [((2, 6, 32, 24), "fma"), ((2, 4, 64, 40), "tc")], ids=["fma", "tc"])
@pytest.mark.parametrize("piece", [64, 128, 192])
def test_chunked_prefill_pieces(monkeypatch, piece, shape, scan):
    """Pieces of the prompt (prep + scan per piece) carry the state over, into state_out too."""
    import lumo.kernels.gdn as G

    nk, nv, dk, dv = shape
    inp = make(333, nk, nv, dk, dv, seed=piece)
    o_ref, s_ref = gdn_prefill_ref(**cpu(inp))
    monkeypatch.setattr(G, "CHUNKED_PIECE_TOKENS", piece)
    state0 = inp["state"].clone()
    s_out = torch.full_like(state0, float("nan"))
    o = gdn_prefill(**inp, out=poisoned(333, nv, dv, torch.float32), state_out=s_out, chunked=True, scan=scan)
    assert torch.equal(inp["state"], state0)
    assert rel(o, o_ref) < 1e-4 and rel(s_out, s_ref) < 1e-4


@pytest.mark.parametrize("scan", ["tc", "fma"])
@pytest.mark.parametrize("a_val,A_log", [(30.0, 1.0), (-30.0, -5.0)], ids=["strong-decay", "no-decay"])
def test_chunked_prefill_extreme_gates(a_val, A_log, scan):
    """Decay ~exp(-80) per token (log decays far below float range inside a chunk) and ~1: finite, and
    equal to the sequential kernel within fp32 rounding."""
    inp = make(200, 2, 4, 64, 64, seed=11)
    inp["a"] = torch.full_like(inp["a"], a_val)
    inp["A_log"] = torch.full_like(inp["A_log"], A_log)
    s_seq, s_chk = inp["state"].clone(), inp["state"].clone()
    o_seq = gdn_prefill(**{**inp, "state": s_seq}, out_dtype=torch.float32, chunked=False)
    o_chk = gdn_prefill(**{**inp, "state": s_chk}, out_dtype=torch.float32, chunked=True, scan=scan)
    assert rel(o_chk, o_seq) < 1e-4 and rel(s_chk, s_seq) < 1e-4


def test_long_prefill_27b():
    T = 3000
    inp = make(T, 16, 48, 128, 128, seed=9)
    o_ref, s_ref = gdn_prefill_ref(**cpu(inp))
    o = gdn_prefill(**inp, out_dtype=torch.float32)  # state updated in place
    assert rel(o, o_ref) < 1e-4 and rel(inp["state"], s_ref) < 1e-4


@pytest.mark.parametrize("nk,nv,dk,dv", SHAPES, ids=IDS)
def test_one_launch_equals_token_by_token(nk, nv, dk, dv):
    """Replay (T tokens in one launch) == plain decoding (T launches of one token), bit for bit."""
    T = 23
    inp = make(T, nk, nv, dk, dv, seed=5 + nv)
    s_chain = inp["state"].clone()
    outs = []
    for t in range(T):
        step = {"mixed": inp["mixed"][t : t + 1], "a": inp["a"][t : t + 1], "b": inp["b"][t : t + 1]}
        outs.append(gdn_decode(**{**inp, **step, "state": s_chain}, out_dtype=torch.float32))
    s_one = inp["state"].clone()
    o_one = gdn_decode(**{**inp, "state": s_one}, out_dtype=torch.float32)
    assert torch.equal(o_one, torch.cat(outs)) and torch.equal(s_one, s_chain)


def test_state_out_leaves_state_untouched():
    inp = make(5, 2, 6, 32, 24, seed=2)
    state0 = inp["state"].clone()
    s_out = torch.full_like(state0, float("nan"))
    o = gdn_decode(**inp, state_out=s_out)
    assert torch.equal(inp["state"], state0)
    o_in = gdn_decode(**inp)  # now in place
    assert torch.equal(o, o_in) and torch.equal(s_out, inp["state"])


def test_strided_views_and_param_dtypes():
    nk, nv, dk, dv, T = 2, 4, 64, 64, 9
    inp = make(T, nk, nv, dk, dv, seed=4)
    C = inp["mixed"].shape[1]
    wide = torch.zeros(T, C + 24, dtype=torch.bfloat16, device=DEV)
    wide[:, 8 : 8 + C] = inp["mixed"]
    ab = torch.cat([inp["b"], inp["a"]], dim=1)  # like a fused in_proj_b | in_proj_a output [T, 2nv]
    ref = gdn_decode(**inp, state_out=torch.empty_like(inp["state"]), out_dtype=torch.float32)
    views = {"mixed": wide[:, 8 : 8 + C], "a": ab[:, nv:], "b": ab[:, :nv]}
    y = gdn_decode(**{**inp, **views}, state_out=torch.empty_like(inp["state"]), out_dtype=torch.float32)
    assert torch.equal(y, ref)
    # bf16 gate parameters give the bits of their exact f32 values; bf16 o is f32 o rounded once.
    A16, dt16 = inp["A_log"].bfloat16(), inp["dt_bias"].bfloat16()
    s1, s2 = torch.empty_like(inp["state"]), torch.empty_like(inp["state"])
    y16 = gdn_decode(**{**inp, "A_log": A16, "dt_bias": dt16}, state_out=s1, out_dtype=torch.float32)
    y32 = gdn_decode(**{**inp, "A_log": A16.float(), "dt_bias": dt16.float()}, state_out=s2)
    assert torch.equal(s1, s2) and torch.equal(y16.bfloat16(), y32)


def test_graph_replay_equals_eager():
    nk, nv, dk, dv = 16, 48, 128, 128
    inp = make(1, nk, nv, dk, dv, seed=8)
    eager_state = inp["state"].clone()
    out = poisoned(1, nv, dv, torch.bfloat16)
    gdn_decode(**{**inp, "state": inp["state"].clone()}, out=out)  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_decode(**inp, out=out)
    for step in range(3):
        fresh = make(1, nk, nv, dk, dv, seed=100 + step)
        for key in ("mixed", "a", "b"):
            inp[key].copy_(fresh[key])
        out.fill_(float("nan"))
        graph.replay()
        o_eager = gdn_decode(**{**inp, "state": eager_state})
        torch.cuda.synchronize()
        assert torch.equal(out, o_eager) and torch.equal(inp["state"], eager_state)


@pytest.mark.parametrize("n", [0, 1, 4, 6])
def test_replay_rows_and_device_count(n):
    """Commit replay: tokens from gathered rows, the accepted count read on the device (graph-friendly)."""
    nk, nv, dk, dv, R = 3, 9, 96, 48, 12
    inp = make(R, nk, nv, dk, dv, seed=20 + n)
    path = torch.tensor([0, 2, 3, 7, 8, 11], dtype=torch.int32, device=DEV)
    count = torch.tensor([n], dtype=torch.int32, device=DEV)
    s_replay = inp["state"].clone()
    o = gdn_decode(
        **{**inp, "state": s_replay}, rows=path, count=count, out=poisoned(6, nv, dv, torch.float32)
    )
    idx = path[:n].long()
    s_plain = inp["state"].clone()
    gathered = {k: inp[k][idx].contiguous() for k in ("mixed", "a", "b")}
    o_plain = gdn_decode(**{**inp, **gathered, "state": s_plain}, out_dtype=torch.float32)
    assert torch.equal(s_replay, s_plain) and torch.equal(o[:n], o_plain)
    assert torch.isnan(o[n:]).all(), "rows past the count must not be written"
