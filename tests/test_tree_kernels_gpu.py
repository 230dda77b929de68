"""GPU: tree kernels vs references; gdn_tree == plain decoding of each node's path, bitwise; commit replay."""

from __future__ import annotations

import random

import pytest
import torch

from lumo.config import TreeConfig
from lumo.engine.tree import TreeBuffers, build_tree, chain_config, gdn_schedule
from lumo.kernels.conv import conv_gather, conv_gather_qk, conv_pred
from lumo.kernels.gdn import gdn_decode
from lumo.kernels.gdn_tree import gdn_qk, gdn_qk_ref, gdn_tree, gdn_tree_ref, gdn_tree_rows
from lumo.kernels.sampling import sample_tokens, sample_tokens_ref
from lumo.kernels.tree_ops import (
    accept_buffers,
    draft_node_table,
    kv_remap,
    kv_remap_ref,
    kv_table,
    topk_select,
    topk_select_ref,
    topk_workspace,
    tree_accept,
    tree_accept_ref,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def random_tree_config(seed: int) -> TreeConfig:
    rng = random.Random(seed)
    depth, topk = rng.randrange(1, 13), rng.randrange(1, 5)
    budget = rng.randrange(depth, depth + (topk - 1) * depth + 1)
    n = 1 + budget
    return TreeConfig(depth=depth, topk=topk, budget=budget, rows=min(64, n + rng.randrange(0, 5)))


TREES = [
    TreeConfig(),
    TreeConfig(depth=4, topk=4, budget=10, rows=16),
    TreeConfig(depth=20, topk=3, budget=40, rows=61),  # > 32 nodes: tree_accept's second node per lane
    chain_config(5),
    *(random_tree_config(s) for s in (1, 2, 3)),
]
TREE_IDS = [f"D{c.depth}-k{c.topk}-b{c.budget}-R{c.rows}" for c in TREES]

# (nk, nv, dk, dv, bf16 gate params): 27B, embedded model, odd ones (DVT 8; 12 rows per lane).
SHAPES = [(16, 48, 128, 128, False), (2, 4, 64, 64, True), (2, 6, 32, 24, False), (3, 9, 96, 48, False)]
SHAPE_IDS = [f"nk{nk}-nv{nv}-dk{dk}-dv{dv}" for nk, nv, dk, dv, _ in SHAPES]


def ancestry(tree: TreeBuffers, u: int) -> list[int]:
    out = []
    while u >= 0:
        out.append(u)
        u = int(tree.parent[u])
    return out[::-1]


def gdn_inputs(R: int, nk: int, nv: int, dk: int, dv: int, pbf16: bool, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    a = torch.randn(R, nv, generator=gen) * 2
    a[0, 0] = 25.0  # softplus identity branch, on the root every path shares
    pdt = torch.bfloat16 if pbf16 else torch.float32
    inp = dict(
        mixed=torch.randn(R, C, generator=gen).to(torch.bfloat16),
        a=a.to(torch.bfloat16),
        b=(torch.randn(R, nv, generator=gen) * 2).to(torch.bfloat16),
        A_log=(torch.rand(nv, generator=gen) * 2 - 1).to(pdt),
        dt_bias=torch.randn(nv, generator=gen).to(pdt),
        state=torch.randn(nv, dk, dv, generator=gen),
    )
    return {k: v.to(DEV) for k, v in inp.items()}


def tree_dev(tree: TreeBuffers) -> dict[str, torch.Tensor]:
    return dict(items=tree.gdn_items.to(DEV), items_len=tree.gdn_items_len.to(DEV))


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    assert torch.isfinite(x).all(), "non-finite output (unwritten element?)"
    return ((x - ref).norm() / ref.norm()).item()


def decode_path(inp: dict[str, torch.Tensor], nodes: list[int], dtype: torch.dtype):
    """Plain decoding: one gdn_decode launch per node, from a copy of the committed state."""
    s = inp["state"].clone()
    outs = []
    for u in nodes:
        step = {k: inp[k][u : u + 1] for k in ("mixed", "a", "b")}
        outs.append(gdn_decode(**{**inp, **step, "state": s}, out_dtype=dtype)[0])
    return torch.stack(outs), s


@pytest.mark.parametrize("max_rows", [None, 3, 64], ids=["paths", "rows3", "rows64"])
@pytest.mark.parametrize("cfg", TREES, ids=TREE_IDS)
@pytest.mark.parametrize("nk,nv,dk,dv,pbf16", SHAPES, ids=SHAPE_IDS)
def test_gdn_tree_equals_decoding_each_path(nk, nv, dk, dv, pbf16, cfg, max_rows):
    tree = build_tree(cfg)
    check_tree(tree.parent[: tree.n_nodes].tolist(), tree.rows, nk, nv, dk, dv, pbf16, max_rows)


# Trees beyond spine + siblings (gdn_schedule takes any tree whose parents precede their children):
# root only, a root with leaf children only, several walking paths sharing prefixes, leaves forked at
# several depths of several paths, and random ones.
def random_parents(seed: int, n: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]


GENERAL = [[-1], [-1, 0, 0, 0], [-1, 0, 1, 1, 0, 4, 4, 2, 5, 5, 3], random_parents(1), random_parents(2)]


@pytest.mark.parametrize("max_rows", [None, 3, 64], ids=["paths", "rows3", "rows64"])
@pytest.mark.parametrize("parent", GENERAL, ids=[f"general{i}" for i in range(len(GENERAL))])
@pytest.mark.parametrize("nk,nv,dk,dv,pbf16", [SHAPES[0], SHAPES[2]], ids=[SHAPE_IDS[0], SHAPE_IDS[2]])
def test_gdn_tree_general_trees(nk, nv, dk, dv, pbf16, parent, max_rows):
    check_tree(parent, len(parent) + 3, nk, nv, dk, dv, pbf16, max_rows)


# + one head per CTA; a CTA holding k heads and v channels; eight heads per CTA
QK_SHAPES = [s[:4] for s in SHAPES] + [(1, 2, 256, 64), (3, 3, 32, 24), (5, 5, 16, 16)]


@pytest.mark.parametrize(
    "nk,nv,dk,dv", QK_SHAPES, ids=[f"nk{a}-nv{b}-dk{c}-dv{d}" for a, b, c, d in QK_SHAPES]
)
def test_normalised_qk(nk, nv, dk, dv):
    """conv_gather_qk: y bitwise conv_gather's, qk bitwise gdn_qk's of y and within f32 noise of the fp32
    l2norm; gdn_tree reading that qk gives every node bitwise the plain decoding of its root-to-node path."""
    heads, C, K = (nk, nv, dk, dv), 2 * nk * dk + nv * dv, 4
    gen = torch.Generator(DEV).manual_seed(dk * 7 + nv)
    tb = build_tree(TreeConfig(depth=4, topk=3, budget=9, rows=13))
    R, parent = tb.parent.shape[0], tb.parent[: tb.n_nodes].tolist()
    x = torch.randn(R, C + 5, generator=gen, device=DEV).to(torch.bfloat16)[:, 2 : 2 + C]  # a strided view
    w = (torch.randn(C, K, generator=gen, device=DEV) * 0.5).to(torch.bfloat16)
    state = torch.randn(C, K - 1, generator=gen, device=DEV).to(torch.bfloat16)
    pred = conv_pred(tb.parent.tolist(), K).to(DEV)
    qk_nan = torch.full((R, 2 * nk * dk), float("nan"), device=DEV)
    y, qk = conv_gather_qk(x, w, state, pred, heads, qk=qk_nan)
    assert torch.equal(y, conv_gather(x, w, state, pred))
    assert torch.equal(qk, gdn_qk(y, heads)), "fused and standalone normalisation differ"
    assert rel(qk, gdn_qk_ref(y.cpu(), heads)) < 1e-6
    if dk > 128:  # (gdn_tree's state tile would not fit its registers)
        return
    inp = gdn_inputs(R, nk, nv, dk, dv, False, seed=dk + nv)
    inp["mixed"] = y
    items, items_len = gdn_schedule(parent, 2)
    o = gdn_tree(**inp, items=items.to(DEV), items_len=items_len.to(DEV), out_dtype=torch.float32, qk=qk)
    for leaf in (u for u in range(len(parent)) if u not in parent):
        nodes = ancestry(tb, leaf)
        o_plain, _ = decode_path(inp, nodes, torch.float32)
        assert torch.equal(o[nodes], o_plain), f"root-to-leaf path {nodes}: tree o != plain decoding"


def test_gdn_tree_rows_fit_one_wave():
    """gdn_tree_rows: the schedule rows whose single-warp CTAs the device holds at once (27B shape)."""
    from lumo.kernels.compile import sm_count
    from lumo.kernels.gdn import _kernel

    dev = torch.device(DEV)
    rows = gdn_tree_rows(16, 48, 128, 128, False, True, dev)
    per_sm = _kernel("gdn_tree", "gdn_tree", 16, 48, 128, 128, False, True).blocks_per_sm(32, 0)
    assert rows >= 1 and per_sm > 0
    assert rows * 48 * 8 <= max(per_sm * sm_count(dev), 48 * 8) < (rows + 1) * 48 * 8


def check_tree(
    parent: list[int], R: int, nk: int, nv: int, dk: int, dv: int, pbf16: bool, max_rows: int | None
) -> None:
    """gdn_tree over the schedule of `parent` (R - len(parent) padding rows; `max_rows`: gdn_schedule's
    fork spreading): every node's o bitwise equal to plain decoding of its root-to-node path, padding
    rows unwritten, the state untouched, and the fp32 reference within bf16 / f32 noise."""
    n = len(parent)
    items, items_len = gdn_schedule(parent, max_rows)
    dtype = torch.bfloat16 if nv == 48 else torch.float32  # the engine's bf16 o at 27B; f32 elsewhere
    inp = gdn_inputs(R, nk, nv, dk, dv, pbf16, seed=R * 31 + nv)
    state0 = inp["state"].clone()
    nan = torch.full((R, nv, dv), float("nan"), dtype=dtype, device=DEV)
    o = gdn_tree(**inp, items=items.to(DEV), items_len=items_len.to(DEV), out=nan)
    assert torch.equal(inp["state"], state0), "the committed state must not be written"
    assert torch.isnan(o[n:].float()).all(), "padding rows must not be written"
    # Plain decoding of each root-to-leaf path covers every node; leaves are forks in the kernel.
    for leaf in (u for u in range(n) if u not in parent):
        nodes, u = [], leaf
        while u >= 0:
            nodes.append(u)
            u = parent[u]
        nodes.reverse()
        o_plain, _ = decode_path(inp, nodes, dtype)
        assert torch.equal(o[nodes], o_plain), f"root-to-leaf path {nodes}: tree o != plain decoding"
    cpu = {k: v.cpu() for k, v in inp.items()}
    ref = gdn_tree_ref(**cpu, items=items, items_len=items_len)
    assert rel(o[:n], ref[:n]) < (5e-3 if dtype == torch.bfloat16 else 1e-4)


def accept_case(tree: TreeBuffers, rng: random.Random, target: int) -> tuple[list[int], list[int]]:
    """Node tokens (siblings distinct, as top-k gives) and target choices accepting root..target."""
    tokens = [rng.randrange(5000) for _ in range(tree.rows)]
    for u in range(tree.n_nodes):  # make children of one node carry distinct tokens
        for r, c in enumerate(tree.children(u)):
            tokens[c] = 100 * u + r
    choice = [rng.randrange(5000) for _ in range(tree.rows)]
    path = ancestry(tree, target)
    for u, v in zip(path, path[1:], strict=False):
        choice[u] = tokens[v]
    choice[target] = 7777  # carried by no child
    return tokens, choice


def i32(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("cfg", [TreeConfig(), random_tree_config(4)], ids=["default", "random4"])
@pytest.mark.parametrize("nk,nv,dk,dv,pbf16", [SHAPES[0], SHAPES[3]], ids=[SHAPE_IDS[0], SHAPE_IDS[3]])
def test_commit_replay_equals_plain_decoding(nk, nv, dk, dv, pbf16, cfg):
    """tree_accept's rows + count drive gdn_decode's replay: the committed state is plain decoding's."""
    tree = build_tree(cfg)
    R, cap = tree.rows, tree.depth_max + 1
    inp = gdn_inputs(R, nk, nv, dk, dv, pbf16, seed=cap + nv)
    o_tree = gdn_tree(**inp, **tree_dev(tree), out_dtype=torch.float32)
    rng = random.Random(nv)
    for target in sorted({0, tree.depth_max, tree.n_nodes - 1, rng.randrange(tree.n_nodes)}):
        tokens, choice = accept_case(tree, rng, target)
        accepted, result = tree_accept(i32(tokens), i32(choice), tree.parent.to(DEV), tree.n_nodes, cap=cap)
        want_acc, want_res = tree_accept_ref(tree, tokens, choice)
        assert torch.equal(accepted.cpu(), want_acc) and torch.equal(result.cpu(), want_res)
        path = ancestry(tree, target)
        assert want_acc[: len(path)].tolist() == path
        s_replay = inp["state"].clone()
        o_rep = torch.full((cap, nv, dv), float("nan"), device=DEV)
        gdn_decode(**{**inp, "state": s_replay}, rows=accepted, count=result[:1], out=o_rep)
        o_plain, s_plain = decode_path(inp, path, torch.float32)
        assert torch.equal(s_replay, s_plain), "replayed state != plain decoding's state"
        assert torch.equal(o_rep[: len(path)], o_plain) and torch.equal(o_tree[path], o_plain)
        assert torch.isnan(o_rep[len(path) :]).all()


def tie_logits(T: int, V: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=gen) * 3
    x[0, V // 2] = x[0, V // 5] = x[0, V - 1] = x[0].max() + 1  # tied maximum
    if T > 1:
        x[1] = (x[1] * 2).round() / 2  # few distinct values: ties everywhere
    if T > 2:
        x[2] = -x[2].abs() - 1
        x[2, ::7] = 0.0
        x[2, 3::7] = -0.0  # -0 == +0, lower id first
    if T > 3:
        x[3, V // 3] = float("nan")
        x[3, V // 4] = -float("nan")
    return x.to(DEV)


@pytest.mark.parametrize("V", [11, 1000, 4097, 151943, 248320])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_select_matches_stable_sort(V, k):
    logits = tie_logits(4, V, seed=V + k)
    ids = topk_select(logits, k, out=torch.full((4, k), -5, dtype=torch.int32, device=DEV))
    assert torch.equal(ids.cpu(), topk_select_ref(logits, k))


@pytest.mark.parametrize("V", [11, 4097, 32768 + 77, 248320])
def test_topk_select_bf16_logits_as_their_f32_values(V):
    """bf16 logits (the drafter's head output, LOGITS_BF16 build) select as their f32 values: ties (many,
    after the rounding), -0 / +0 and NaN included."""
    logits = tie_logits(4, V, seed=3 * V).to(torch.bfloat16)
    for k in (1, 3, 8):
        ids = topk_select(logits, k, out=torch.full((4, k), -5, dtype=torch.int32, device=DEV))
        assert torch.equal(ids, topk_select(logits.float(), k))
        assert torch.equal(ids.cpu(), topk_select_ref(logits, k))


@pytest.mark.parametrize("V", [9, 4097, 32768 + 77])
def test_topk_select_maps_columns_to_draft_vocabulary_ids(V):
    """With an id map (a draft vocabulary) the ids and the tree's tokens are id_map[column]."""
    k = 3
    logits = tie_logits(4, V, seed=V)
    id_map = torch.sort(torch.randperm(3 * V, device=DEV)[:V]).values.to(torch.int32)
    table = torch.tensor([[1, -1, 2], [3, 4, -1], [5, 6, 7], [-1, -1, 8]], dtype=torch.int32, device=DEV)
    tokens = torch.full((9,), -7, dtype=torch.int32, device=DEV)
    ids = topk_select(logits, k, tokens=tokens, nodes=table, id_map=id_map)
    want = id_map.cpu()[topk_select_ref(logits, k).long()]
    assert torch.equal(ids.cpu(), want)
    expect = [-7] * 9
    for t in range(4):
        for r in range(k):
            if table[t, r] >= 0:
                expect[int(table[t, r])] = int(want[t, r])
    assert tokens.tolist() == expect
    with pytest.raises(ValueError, match="id_map"):
        topk_select(logits, k, id_map=id_map[:-1])


@pytest.mark.parametrize("V", [4097, 248320])
@pytest.mark.parametrize("mapped", [False, True], ids=["all", "draft-vocab"])
@pytest.mark.parametrize("biased", [False, True], ids=["", "biased"])
def test_topk_select_under_penalties(V, mapped, biased):
    """The drafter's candidates under the penalties (and the logit bias): topk of the CPU-adjusted logits,
    whose history is the counts (over token ids, through the id map) plus the spine drafted so far,
    tokens[1 : 1 + n_path]; the bias over token ids too."""
    from lumo.engine.sampling import SamplingParams, adjust, bias_vector
    from lumo.kernels.sampling import Penalties

    gen = torch.Generator().manual_seed(V)
    Vall = 2 * V if mapped else V
    id_map = torch.sort(torch.randperm(Vall, generator=gen)[:V]).values.to(torch.int32) if mapped else None
    cols = id_map.long() if mapped else torch.arange(V)
    logits = torch.randn(1, V, generator=gen) * 3
    best = logits[0].topk(6).indices
    counts = torch.zeros(Vall, dtype=torch.int32)
    counts[cols[best[:2]]] = torch.tensor([1, 3], dtype=torch.int32)  # generated before
    prompt = torch.zeros(Vall, dtype=torch.uint8)
    prompt[cols[best[2]]] = 1
    tokens = torch.full((12,), 0, dtype=torch.int32)
    tokens[1:4] = cols[best[3:6]].int()  # the spine so far: three of the best tokens
    bias = ()
    if biased:  # the best column banned, the 20th lifted (over token ids), a few random ones moved
        moved = torch.randint(0, V, (30,), generator=gen)
        bias = {int(cols[j]): float(torch.randn(1, generator=gen)) for j in moved}
        bias |= {int(cols[best[0]]): -100.0, int(cols[logits[0].topk(20).indices[-1]]): 5.0}
        bias = tuple(sorted(bias.items()))
    params = SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=1.0, logit_bias=bias
    )
    row = torch.tensor([Penalties.row(params)]).to(DEV)
    bias_dev = bias_vector(bias, Vall).to(DEV) if biased else None
    pen = Penalties(row, counts.to(DEV), prompt.to(DEV), bias=bias_dev)
    for n_path in (0, 3):
        history = pen.history(extra=tokens[1 : 1 + n_path].tolist())
        want = topk_select_ref(adjust(_full(logits[0], cols, Vall), params, history)[cols][None], 8)
        want = cols[want.long()].int() if mapped else want
        ids = topk_select(
            logits.to(DEV),
            8,
            tokens=tokens.to(DEV),
            nodes=torch.full((1, 8), -1, dtype=torch.int32, device=DEV),
            id_map=None if id_map is None else id_map.to(DEV),
            penalties=pen,
            n_path=n_path,
        )
        assert torch.equal(ids.cpu(), want), n_path
        assert not torch.equal(
            want, topk_select_ref(logits, 8) if not mapped else cols[topk_select_ref(logits, 8).long()].int()
        )


def _full(row: torch.Tensor, cols: torch.Tensor, n: int) -> torch.Tensor:
    """A draft vocabulary's logits row spread over the n token ids (0 elsewhere: never read back)."""
    out = torch.zeros(n)
    out[cols] = row
    return out


def test_topk_scatter_into_tree_and_graph_replay():
    """D drafter steps fill the tree's token buffer through the node table, eager and from a CUDA graph."""
    tree = build_tree(TreeConfig())
    table = draft_node_table(tree).to(DEV)  # [D, k]
    D, k, V = table.shape[0], table.shape[1], 248320
    logits = tie_logits(D, V, seed=5)
    tokens = torch.full((tree.rows,), -7, dtype=torch.int32, device=DEV)
    ids = torch.empty(D, k, dtype=torch.int32, device=DEV)
    ws = topk_workspace(1, V, DEV)

    def draft():
        for d in range(D):  # one launch pair per MTP step, as in the captured drafter
            topk_select(
                logits[d : d + 1], k, out=ids[d : d + 1], tokens=tokens, nodes=table[d : d + 1], workspace=ws
            )

    def expected() -> list[int]:
        ref = topk_select_ref(logits, k)
        want = [-7] * tree.rows
        for i in range(1, tree.n_nodes):
            want[i] = int(ref[int(tree.depth[i]) - 1, int(tree.rank[i])])
        return want

    draft()
    assert tokens.tolist() == expected()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        draft()
    for seed in (6, 7):
        logits.copy_(tie_logits(D, V, seed=seed))
        tokens.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert tokens.tolist() == expected()


@pytest.mark.parametrize("cfg", TREES, ids=TREE_IDS)
def test_tree_accept_matches_reference(cfg):
    tree = build_tree(cfg)
    cap = tree.depth_max + 1
    rng = random.Random(cfg.rows)
    parent = tree.parent.to(DEV)
    accepted, result = accept_buffers(cap, DEV)
    for trial in range(30):
        if trial % 3 == 2:  # tiny vocabulary: duplicate tokens among siblings, the lowest id must win
            tokens = [rng.randrange(3) for _ in range(tree.rows)]
            choice = [rng.randrange(3) for _ in range(tree.rows)]
        else:
            tokens, choice = accept_case(tree, rng, rng.randrange(tree.n_nodes))
        accepted.fill_(-9)
        result.fill_(-9)
        counts = torch.randint(0, 3, (8000,), dtype=torch.int32)  # the penalties' token histogram
        out = dict(accepted=accepted, result=result, count_out=counts.to(DEV))
        tree_accept(i32(tokens), i32(choice), parent, tree.n_nodes, **out)
        want_acc, want_res = tree_accept_ref(tree, tokens, choice)
        assert torch.equal(accepted.cpu(), want_acc) and torch.equal(result.cpu(), want_res), trial
        emitted = want_res[2 : 2 + int(want_res[0])].long()
        counts.index_add_(0, emitted, torch.ones_like(emitted, dtype=torch.int32))  # every emitted token once
        assert torch.equal(out["count_out"].cpu(), counts), trial


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_tree_accept_with_sampled_choices(greedy):
    """Choices from sample_tokens at positions len + depth + 1 (as the engine draws them)."""
    tree = build_tree(TreeConfig())
    R, V, L, cap = tree.rows, 3001, 40, tree.depth_max + 1
    gen = torch.Generator().manual_seed(int(greedy))
    logits = (torch.randn(R, V, generator=gen) * 2).to(DEV)
    temp = torch.full((R,), 0.0 if greedy else 0.8, device=DEV)
    params = dict(
        temperature=temp,
        top_k=torch.full((R,), 0 if greedy else 50, dtype=torch.int32, device=DEV),
        top_p=torch.full((R,), 1.0 if greedy else 0.9, device=DEV),
        seed=torch.full((R,), 1234, dtype=torch.int64, device=DEV),
        position=(L + tree.depth.long() + 1).to(DEV),
    )
    choice = sample_tokens(logits, **params)
    want_choice = sample_tokens_ref(logits.cpu(), **{k: v.cpu() for k, v in params.items()})
    assert torch.equal(choice.cpu(), want_choice)
    # drafts: agree with the target along spine nodes 1..6, then the target's pick sits on a sibling at depth
    # 7 (a child of spine node 6) and not on spine node 7
    tokens = torch.randint(0, V, (R,), generator=gen, dtype=torch.int32)
    c = want_choice.tolist()
    for u in range(1, 7):
        tokens[u] = c[u - 1]
    sib = next(i for i in range(tree.depth_max + 1, tree.n_nodes) if int(tree.parent[i]) == 6)
    tokens[sib] = c[6]
    tokens[7] = (c[6] + 1) % V
    accepted, result = tree_accept(tokens.to(DEV), choice, tree.parent.to(DEV), tree.n_nodes, cap=cap)
    want_acc, want_res = tree_accept_ref(tree, tokens.tolist(), c)
    assert torch.equal(accepted.cpu(), want_acc) and torch.equal(result.cpu(), want_res)
    assert want_acc[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, sib] and int(want_res[0]) == 8


@pytest.mark.parametrize(
    "nkv,d,dtype",
    [(4, 256, torch.bfloat16), (2, 64, torch.bfloat16), (3, 72, torch.bfloat16), (4, 256, torch.float32)],
)
def test_kv_remap_matches_reference(nkv, d, dtype):
    max_len, n_caches = 173, 5
    gen = torch.Generator().manual_seed(nkv * d)
    caches = [torch.randn(max_len, nkv, d, generator=gen).to(dtype).to(DEV) for _ in range(n_caches)]
    table = kv_table(caches)
    rng = random.Random(d)
    trees = [build_tree(TreeConfig()), build_tree(random_tree_config(9))]
    for trial in range(12):
        tree = trees[trial % 2]
        cap = tree.depth_max + 1
        length = rng.randrange(0, max_len - tree.rows + 1)
        target = rng.choice([rng.randrange(tree.n_nodes), tree.depth_max, tree.n_nodes - 1])
        path = ancestry(tree, target)
        acc = path + [-1] * (cap - len(path))
        before = [c.detach().clone().cpu() for c in caches]
        want = kv_remap_ref(before, acc, len(path), length)
        kv_remap(table, i32(acc), i32([len(path)]), i32([length]))
        for c, w, b in zip(caches, want, before, strict=True):
            assert torch.equal(c.cpu(), w), f"trial {trial}: cache differs from the reference"
            assert torch.equal(c.cpu()[length : length + len(path)], b[[length + a for a in path]])


def test_kv_remap_arbitrary_topological_paths():
    """Paths of non-spine-contiguous trees (a_j > j early): in-place moves still equal the gather."""
    rng = random.Random(3)
    caches = [torch.randn(90, 2, 64, device=DEV).bfloat16() for _ in range(2)]
    table = kv_table(caches)
    for _ in range(20):
        n = rng.randrange(2, 40)
        parent = [-1] + [rng.randrange(i) for i in range(1, n)]
        path, v = [], rng.randrange(n)
        while v >= 0:
            path.append(v)
            v = parent[v]
        path.reverse()
        length = rng.randrange(0, 90 - n)
        before = [c.detach().clone().cpu() for c in caches]
        kv_remap(table, i32(path + [-1]), i32([len(path)]), i32([length]))
        for c, b in zip(caches, before, strict=True):
            assert torch.equal(c.cpu()[length : length + len(path)], b[[length + a for a in path]])
            assert torch.equal(c.cpu()[:length], b[:length])


def test_accept_and_remap_graph_replay():
    """tree_accept -> kv_remap captured once; replays with new choices equal the references."""
    tree = build_tree(TreeConfig())
    cap, R = tree.depth_max + 1, tree.rows
    caches = [torch.randn(64, 4, 256, device=DEV).bfloat16() for _ in range(4)]
    table = kv_table(caches)
    tokens, choice = i32([0] * R), i32([0] * R)
    parent, length = tree.parent.to(DEV), i32([9])
    accepted, result = accept_buffers(cap, DEV)
    tree_accept(tokens, choice, parent, tree.n_nodes, accepted=accepted, result=result)
    kv_remap(table, accepted, result[:1], length)  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree_accept(tokens, choice, parent, tree.n_nodes, accepted=accepted, result=result)
        kv_remap(table, accepted, result[:1], length)
    rng = random.Random(11)
    for target in (3, tree.n_nodes - 1, 0, 20):
        tk, ch = accept_case(tree, rng, target)
        tokens.copy_(i32(tk))
        choice.copy_(i32(ch))
        before = [c.detach().clone().cpu() for c in caches]
        graph.replay()
        torch.cuda.synchronize()
        want_acc, want_res = tree_accept_ref(tree, tk, ch)
        assert torch.equal(accepted.cpu(), want_acc) and torch.equal(result.cpu(), want_res)
        want = kv_remap_ref(before, want_acc.tolist(), int(want_res[0]), 9)
        for c, w in zip(caches, want, strict=True):
            assert torch.equal(c.cpu(), w)
