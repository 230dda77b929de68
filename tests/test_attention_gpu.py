"""GPU: attn_decode (split-K tree/decode kernel) and attn_prefill vs fp32 references, batch invariance,
tree row == plain decode bitwise, graph replay with a new length."""

from __future__ import annotations

import pytest
import torch

from lumo.kernels.attention import (
    CHUNK,
    attn_decode,
    attn_decode_ref,
    attn_decode_workspace,
    attn_prefill,
    attn_prefill_ref,
    tree_chunk_fits,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def rand_tree(T: int, gen: torch.Generator) -> list[int]:
    """Ancestor bitmasks of a random tree whose parents precede their children (row 0 = root)."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    masks = []
    for i in range(T):
        bits, j = 0, i
        while j >= 0:
            bits |= 1 << j
            j = parent[j]
        masks.append(bits)
    return masks


def setup(max_len, T, nh, nkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(max_len, nkv, d, generator=gen).to(torch.bfloat16).to(DEV)
    vc = torch.randn(max_len, nkv, d, generator=gen).to(torch.bfloat16).to(DEV)
    q = (torch.randn(T, nh, d, generator=gen) * 2).to(torch.bfloat16).to(DEV)
    gate = torch.randn(T, nh, d, generator=gen).to(torch.bfloat16).to(DEV)
    if T > 63:  # prefill shapes: no tree, and a 64-bit ancestor mask holds at most 63 rows as int64
        return kc, vc, q, gate, None
    masks = rand_tree(T, gen) if T > 1 else [1]
    return kc, vc, q, gate, torch.tensor(masks, dtype=torch.int64, device=DEV)


def length_t(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int32, device=DEV)


HEADS = [
    (4, 2, 64),
    (12, 4, 64),
    (10, 2, 64),
    (16, 4, 128),
    (6, 1, 256),
    (24, 4, 256),
    (8, 4, 256),
    (16, 1, 128),
    (12, 1, 64),
    (9, 1, 256),  # G > 8: a row's heads fill more than one P.V pass
]


@pytest.mark.parametrize("nh,nkv,d", HEADS, ids=[f"nh{a}-nkv{b}-d{c}" for a, b, c in HEADS])
@pytest.mark.parametrize("length", [0, 1, 255, 256, 300, 1111, -1111])
@pytest.mark.parametrize("T", [1, 7, 32])
def test_decode_matches_reference(nh, nkv, d, length, T):
    max_len = length + 40 if length >= 0 else 16384  # -n: length n in a long cache (split query rows)
    length = abs(length)
    kc, vc, q, gate, mask = setup(max_len, T, nh, nkv, d, seed=length * 100 + T + nh)
    use_gate = (length + T) % 2 == 0
    out = torch.full_like(q, float("nan"))
    got = attn_decode(q, kc, vc, length_t(length), mask, gate=gate if use_gate else None, out=out)
    ref = attn_decode_ref(q, kc, vc, length, mask.cpu(), gate=gate if use_gate else None)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("nh,nkv,d", [(4, 2, 64), (24, 4, 256)], ids=["nh4-nkv2-d64", "nh24-nkv4-d256"])
@pytest.mark.parametrize(
    "length,max_len",
    [(5, 69), (250, 314), (513, 577), (300, 16384), (1100, 16384), (9000, 16384), (40000, 40100)],
    ids=["5", "250", "513", "300-of-16k", "1100-of-16k", "9000-of-16k", "40000"],
)
def test_tree_rows_equal_plain_decode_bitwise(nh, nkv, d, length, max_len):
    """Also where a long cache holds a short prefix (the runner's case): fewer chunks below the length
    than chunk slots, so the slot CTAs split a tree's query rows among them (attention.cu), while plain
    decode (one row) keeps whole chunks per CTA; 9000 of 16k keeps whole chunks for the tree rows too
    (more than half as many chunks as slots), and at 40000 every slot CTA walks several chunks. Tree rows
    run on attn_tree_chunk where it fits (a warp per query tile), plain decode on attn_decode_chunk."""
    T = 32
    kc, vc, q, gate, mask = setup(max_len, T, nh, nkv, d, seed=length + d)
    tree = attn_decode(q, kc, vc, length_t(length), mask, gate=gate)
    masks = mask.tolist()
    for i in range(T):
        path = [j for j in range(T) if masks[i] >> j & 1]  # ancestors in depth order, then i
        # Plain decoding after committing the ancestors: their K/V at positions length.., i's K/V after them.
        kc2, vc2 = kc.clone(), vc.clone()
        for m, j in enumerate(path):
            kc2[length + m], vc2[length + m] = kc[length + j], vc[length + j]
        one = torch.ones(1, dtype=torch.int64, device=DEV)
        plain = attn_decode(
            q[i : i + 1], kc2, vc2, length_t(length + len(path) - 1), one, gate=gate[i : i + 1]
        )
        assert torch.equal(plain[0], tree[i]), f"row {i} (depth {len(path) - 1})"


TREE_SHAPES = [(24, 4, 256), (4, 2, 64), (16, 1, 128), (9, 1, 256), (12, 4, 64), (32, 2, 128)]


@pytest.mark.parametrize("nh,nkv,d", TREE_SHAPES, ids=[f"nh{a}-nkv{b}-d{c}" for a, b, c in TREE_SHAPES])
@pytest.mark.parametrize("T", [2, 7, 32])
@pytest.mark.parametrize(
    "length,max_len",
    [(700, 764), (300, 8192), (5000, 5100), (17000, 17100)],
    ids=["700", "300-of-8k", "5000", "17000"],
)
def test_tree_chunk_kernel_equals_decode_chunk_kernel(nh, nkv, d, T, length, max_len):
    """attn_tree_chunk (its walking CTAs: a warp per query tile over whole chunks staged in shared memory)
    writes the same split-K partials as attn_decode_chunk (a warp per 16 keys, sub-partials combined across
    warps), bit for bit, for every row: odd query-head counts (G = 9, 16: a tile holds parts of several rows;
    32 tiles for 8 warps), partial last tiles, short prefixes whose slots split the rows (chunk_partials in
    both) and long ones walked chunk by chunk (17000: more than half as many chunks as slots per kv head
    for every shape, up to 132 slots on an H200)."""
    if not tree_chunk_fits(d, DEV):
        pytest.skip("this device's shared memory per block does not hold attn_tree_chunk's")
    kc, vc, q, gate, mask = setup(max_len, T, nh, nkv, d, seed=length + 7 * T + nh)
    outs, parts = [], []
    for tree_chunk in (True, False):
        ws = tuple(torch.full_like(w, float("nan")) for w in attn_decode_workspace(T, nh, d, max_len, DEV))
        n = length_t(length)
        outs.append(attn_decode(q, kc, vc, n, mask, gate=gate, workspace=ws, tree_chunk=tree_chunk))
        parts.append(ws)
    nb = length // CHUNK  # chunks below the length: the slot CTAs' partials (the tail CTAs are shared code)
    assert torch.isfinite(parts[0][0][:, :, :nb]).all() and torch.isfinite(parts[0][1][:, :, :nb]).all()
    assert torch.equal(parts[0][0][:, :, :nb], parts[1][0][:, :, :nb])
    assert torch.equal(parts[0][1][:, :, :nb], parts[1][1][:, :, :nb])
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], attn_decode_ref(q, kc, vc, length, mask.cpu(), gate=gate)) < 1e-2


PIPE_SHAPES = [(24, 4, 256), (4, 2, 64), (16, 1, 128), (9, 1, 256), (32, 2, 128), (6, 6, 64)]


@pytest.mark.parametrize("nh,nkv,d", PIPE_SHAPES, ids=[f"nh{a}-nkv{b}-d{c}" for a, b, c in PIPE_SHAPES])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize(
    "length,max_len", [(129, 8192), (4999, 5100), (40007, 40100)], ids=["129", "4999", "40007"]
)
def test_pipelined_decode_chunk_kernel_equals_decode_chunk_kernel(nh, nkv, d, T, length, max_len):
    """attn_decode_chunk_pipe (a walking CTA loads its next chunk's K during this one) writes the same
    split-K partials and outputs as attn_decode_chunk, bit for bit: one row (the plain decode) and two rows
    where they fit one query tile (T x G <= 16, else both run the same code), CTAs walking one chunk or many
    (40007 positions: ~10 chunks per CTA on an H200), the last chunk partial."""
    kc, vc, q, gate, mask = setup(max_len, T, nh, nkv, d, seed=length + 5 * T + nh)
    outs, parts = [], []
    for pipe in (True, False):
        ws = tuple(torch.full_like(w, float("nan")) for w in attn_decode_workspace(T, nh, d, max_len, DEV))
        outs.append(attn_decode(q, kc, vc, length_t(length), mask, gate=gate, workspace=ws, pipe=pipe))
        parts.append(ws)
    nc = -(-(length + T) // CHUNK)  # every chunk a row sees
    assert torch.isfinite(parts[0][0][:, :, :nc]).all() and torch.isfinite(parts[0][1][:, :, :nc]).all()
    assert torch.equal(parts[0][0][:, :, :nc], parts[1][0][:, :, :nc])
    assert torch.equal(parts[0][1][:, :, :nc], parts[1][1][:, :, :nc])
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], attn_decode_ref(q, kc, vc, length, mask.cpu(), gate=gate)) < 1e-2


def test_strided_gate_equals_contiguous_gate():
    """The gate may be a view into the q projection ([T, nh, 2d] -> [:, :, d:]): same bits as a copy."""
    T, nh, nkv, d, length = 5, 24, 4, 256, 333
    kc, vc, q, gate, mask = setup(length + 64, T, nh, nkv, d, seed=3)
    qg = torch.cat([q, gate], dim=-1)  # [T, nh, 2d]
    strided = attn_decode(q, kc, vc, length_t(length), mask, gate=qg[:, :, d:])
    assert torch.equal(strided, attn_decode(q, kc, vc, length_t(length), mask, gate=gate))


def test_rows_independent_of_batch_and_order():
    T, nh, nkv, d, length = 32, 24, 4, 256, 700
    kc, vc, q, gate, mask = setup(length + 64, T, nh, nkv, d, seed=11)
    full = attn_decode(q, kc, vc, length_t(length), mask, gate=gate)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(1)).to(DEV)
    permuted = attn_decode(
        q[perm].contiguous(), kc, vc, length_t(length), mask[perm].contiguous(), gate[perm]
    )
    assert torch.equal(permuted, full[perm])
    for lo, hi in [(0, 1), (3, 4), (5, 18), (31, 32)]:
        sub = attn_decode(q[lo:hi], kc, vc, length_t(length), mask[lo:hi].contiguous(), gate=gate[lo:hi])
        assert torch.equal(sub, full[lo:hi])


def test_graph_replay_follows_device_length():
    T, nh, nkv, d, max_len = 5, 24, 4, 256, 2048
    kc, vc, q, gate, mask = setup(max_len, T, nh, nkv, d, seed=5)
    length = length_t(100)
    ws = attn_decode_workspace(T, nh, d, max_len, DEV)
    out = torch.empty_like(q)
    attn_decode(q, kc, vc, length, mask, gate=gate, out=out, workspace=ws)  # compile + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn_decode(q, kc, vc, length, mask, gate=gate, out=out, workspace=ws)
    for n in (100, 1, 777, 2000):
        length.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        eager = attn_decode(q, kc, vc, length_t(n), mask, gate=gate)
        assert torch.equal(out, eager), n
        assert rel_err(out, attn_decode_ref(q, kc, vc, n, mask.cpu(), gate=gate)) < 1e-2


PREFILL = [(0, 37, 24, 4, 256), (300, 129, 24, 4, 256), (1000, 64, 4, 2, 64), (17, 5, 6, 3, 64)]


@pytest.mark.parametrize(
    "start,T,nh,nkv,d", PREFILL, ids=[f"s{s}-T{t}-nh{h}-nkv{k}-d{d}" for s, t, h, k, d in PREFILL]
)
def test_prefill_matches_reference(start, T, nh, nkv, d):
    kc, vc, q, gate, _ = setup(start + T + 8, T, nh, nkv, d, seed=start + T)
    assert rel_err(attn_prefill(q, kc, vc, start), attn_prefill_ref(q, kc, vc, start)) < 1e-2
    got = attn_prefill(q, kc, vc, start, gate=gate, out=torch.full_like(q, float("nan")))
    assert rel_err(got, attn_prefill_ref(q, kc, vc, start, gate=gate)) < 1e-2
