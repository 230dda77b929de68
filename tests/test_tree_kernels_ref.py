"""CPU: references of the tree kernels (gdn_tree, topk_select, tree_accept, kv_remap) against lumo.engine."""

from __future__ import annotations

import random

import pytest
import torch

from lumo import model as M
from lumo.config import TreeConfig
from lumo.engine.decode import SpecDecoder
from lumo.engine.sampling import SamplingParams
from lumo.engine.tree import TreeBuffers, accept, build_tree, chain_config, gdn_schedule
from lumo.kernels.conv import conv_commit_rows
from lumo.kernels.gdn import gdn_decode_ref
from lumo.kernels.gdn_tree import gdn_tree_ref, gdn_tree_rows, gdn_tree_written
from lumo.kernels.tree_ops import draft_node_table, kv_remap_ref, topk_select_ref, tree_accept_ref

TREES = [
    TreeConfig(),
    TreeConfig(depth=4, topk=4, budget=10, rows=16),
    TreeConfig(depth=6, topk=2, budget=9, rows=13),
    TreeConfig(depth=20, topk=3, budget=40, rows=61),
    chain_config(5),
]
TREE_IDS = [f"D{c.depth}-k{c.topk}-b{c.budget}-R{c.rows}" for c in TREES]


def ancestry(tree: TreeBuffers, u: int) -> list[int]:
    out = []
    while u >= 0:
        out.append(u)
        u = int(tree.parent[u])
    return out[::-1]


TREE_PARENT_DEFAULT = build_tree(TreeConfig()).parent[:28].tolist()


def gdn_inputs(R: int, nk: int, nv: int, dk: int, dv: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    return dict(
        mixed=torch.randn(R, C, generator=gen).to(torch.bfloat16),
        a=(torch.randn(R, nv, generator=gen) * 2).to(torch.bfloat16),
        b=(torch.randn(R, nv, generator=gen) * 2).to(torch.bfloat16),
        A_log=torch.rand(nv, generator=gen) * 2 - 1,
        dt_bias=torch.randn(nv, generator=gen),
        state=torch.randn(nv, dk, dv, generator=gen),
    )


@pytest.mark.parametrize("cfg", TREES[:3] + TREES[4:], ids=TREE_IDS[:3] + TREE_IDS[4:])
def test_gdn_tree_ref_is_decoding_along_each_ancestry(cfg):
    """Each node's o = plain decoding of root..node from the committed state (SpecDecoder's snapshots)."""
    tree = build_tree(cfg)
    inp = gdn_inputs(tree.rows, 2, 4, 32, 24, seed=cfg.rows)
    state0 = inp["state"].clone()
    o = gdn_tree_ref(**inp, items=tree.gdn_items, items_len=tree.gdn_items_len)
    assert torch.equal(inp["state"], state0)
    check_each_ancestry(o, inp, tree.parent.tolist(), tree.n_nodes)


@pytest.mark.parametrize("max_rows", [None, 3, 64], ids=["paths", "rows3", "rows64"])
@pytest.mark.parametrize(
    "parent", [[-1], [-1, 0, 0], [-1, 0, 1, 1, 0, 4, 4, 2, 5, 5, 3], TREE_PARENT_DEFAULT], ids=str
)
def test_gdn_tree_ref_general_trees(parent, max_rows):
    """Any tree whose parents precede their children (gdn_schedule is not tied to spine + siblings), with
    or without its forks spread over several rows."""
    R = len(parent) + 2  # two padding rows
    items, items_len = gdn_schedule(parent, max_rows)
    inp = gdn_inputs(R, 2, 4, 32, 24, seed=R)
    o = gdn_tree_ref(**inp, items=items, items_len=items_len)
    check_each_ancestry(o, inp, parent + [-1, -1], len(parent))
    assert gdn_tree_written(items, items_len, R).tolist() == [True] * len(parent) + [False, False]


def test_gdn_tree_rows_needs_cuda():
    """Off CUDA there is no occupancy to ask: no cap (gdn_schedule then spreads the forks freely)."""
    assert gdn_tree_rows(2, 4, 32, 24, False, False, torch.device("cpu")) is None


def check_each_ancestry(o: torch.Tensor, inp: dict[str, torch.Tensor], parent: list[int], n: int) -> None:
    for u in range(n):
        nodes, v = [], u
        while v >= 0:
            nodes.append(v)
            v = parent[v]
        rows = {k: inp[k][torch.tensor(nodes[::-1])] for k in ("mixed", "a", "b")}
        o_u, _ = gdn_decode_ref(**{**inp, **rows})
        torch.testing.assert_close(o[u], o_u[-1], rtol=1e-6, atol=1e-6)
    assert (o[n:] == 0).all()


class _FakeCache:
    length = 7


def test_draft_node_table_matches_spec_decoder(monkeypatch):
    """Scattering topk_select_ref through draft_node_table fills the tokens SpecDecoder._draft drafts."""
    cfg = TreeConfig(depth=5, topk=3, budget=12, rows=18)
    tree = build_tree(cfg)
    V = 50
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(cfg.depth, V, generator=gen)  # distinct values: tie order does not matter here
    steps = iter(logits[1:])

    def fake_mtp_forward(cfg_, w, hidden, ids, cache, start):
        return next(steps)[None, None], torch.zeros(1, 1, 4)

    monkeypatch.setattr(M, "mtp_forward", fake_mtp_forward)
    dec = object.__new__(SpecDecoder)
    dec.cfg, dec.w, dec.device, dec.tree, dec.pending, dec.draft_ids = None, None, "cpu", tree, 11, None
    dec.draft_logits, dec.draft_hidden, dec.cache = logits[0], torch.zeros(1, 4), _FakeCache()
    dec.params = SamplingParams(temperature=0.0)  # no bias, no penalties: the raw draft logits
    want = dec._draft()

    table = draft_node_table(tree)
    ids = topk_select_ref(logits, table.shape[1])
    tokens = [11] + [0] * (tree.rows - 1)
    for d in range(cfg.depth):
        for r in range(table.shape[1]):
            if int(table[d, r]) >= 0:
                tokens[int(table[d, r])] = int(ids[d, r])
    assert tokens == want


@pytest.mark.parametrize("V,k", [(9, 8), (300, 3), (1000, 1)])
def test_topk_ref_order_and_ties(V, k):
    gen = torch.Generator().manual_seed(V + k)
    x = (torch.randn(4, V, generator=gen) * 2).round() / 2  # few distinct values: many ties
    x[1] = 0.0
    x[1, ::3] = -0.0  # -0 == +0: lower id first
    x[2, V // 2] = float("nan")
    x[2, V // 3] = -float("nan")
    ids = topk_select_ref(x, k)
    assert ids.dtype == torch.int32 and ids.shape == (4, k)
    for t in range(4):
        row = x[t].clone()
        row[row.isnan()] = float("inf")  # NaN sorts above everything
        sel = ids[t].long()
        v = row[sel]
        assert len(set(sel.tolist())) == k
        for r in range(k - 1):  # descending, ties by lower id
            assert v[r] > v[r + 1] or (v[r] == v[r + 1] and sel[r] < sel[r + 1])
        rest = torch.ones(V, dtype=torch.bool)
        rest[sel] = False
        # nothing left out beats the last pick, nor ties it with a lower id
        later = (row[rest] > v[-1]) | ((row[rest] == v[-1]) & (torch.arange(V)[rest] < sel[-1]))
        assert not later.any()
    assert ids[2, 0] == min(V // 3, V // 2)


def choices_along(tree: TreeBuffers, tokens: list[int], target: int, rng: random.Random) -> list[int]:
    """Target choices that accept exactly root..target (then a token no child carries)."""
    choice = [rng.randrange(6) for _ in range(tree.rows)]
    path = ancestry(tree, target)
    for u, v in zip(path, path[1:], strict=False):
        choice[u] = tokens[v]
    choice[target] = 1000 + target
    return choice


@pytest.mark.parametrize("cfg", TREES, ids=TREE_IDS)
def test_tree_accept_ref_layout(cfg):
    tree = build_tree(cfg)
    rng = random.Random(cfg.rows)
    cap = tree.depth_max + 1
    for trial in range(40):
        tokens = [rng.randrange(6) for _ in range(tree.rows)]  # duplicates among siblings: lowest id wins
        if trial % 2:
            choice = choices_along(tree, tokens, rng.randrange(tree.n_nodes), rng)
        else:
            choice = [rng.randrange(6) for _ in range(tree.rows)]
        path, pending = accept(tree, tokens, choice)
        accepted, result = tree_accept_ref(tree, tokens, choice)
        n = len(path)
        assert accepted.shape == (cap,) and result.shape == (cap + 2,)
        assert accepted.tolist() == path + [-1] * (cap - n)
        # the conv commit rows and the GDN replay rows are the accepted list itself
        assert torch.equal(accepted, conv_commit_rows(path, cap))
        assert int(result[0]) == n and int(result[1]) == pending
        # emitted tokens as SpecDecoder.step emits them
        assert result[2 : 2 + n].tolist() == [tokens[i] for i in path[1:]] + [pending]
        assert (result[2 + n :] == -1).all()


def random_topological_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def test_kv_remap_in_place_equals_gather():
    """The in-place ordered moves == the out-of-place gather new[len + j] = old[len + a_j], for every
    root-to-node path of spine-contiguous trees and of arbitrary topologically ordered trees."""
    rng = random.Random(0)
    max_len, length = 120, 23
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(max_len, 2, 3, generator=gen) for _ in range(3)]
    parent_sets = [build_tree(c).parent.tolist()[: build_tree(c).n_nodes] for c in TREES]
    parent_sets += [random_topological_parents(rng.randrange(2, 64), rng) for _ in range(20)]
    for parent in parent_sets:
        for u in range(len(parent)):
            path, v = [], u
            while v >= 0:
                path.append(v)
                v = parent[v]
            path.reverse()
            cap = len(path) + 2
            acc = path + [-1] * (cap - len(path))
            new = kv_remap_ref(caches, acc, len(path), length)
            for old, c in zip(caches, new, strict=True):
                assert torch.equal(c[:length], old[:length])
                assert torch.equal(c[length : length + len(path)], old[[length + a for a in path]])
                if path == list(range(len(path))):  # spine prefix: nothing moves
                    assert torch.equal(c, old)


def test_kv_remap_ref_count_limits_moves():
    caches = [torch.arange(40, dtype=torch.float32).view(20, 2)]
    new = kv_remap_ref(caches, [0, 3, 5, -1], 2, 4)  # only j = 1 moves: row 7 -> row 5
    want = caches[0].clone()
    want[5] = caches[0][7]
    assert torch.equal(new[0], want)
