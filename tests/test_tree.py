from __future__ import annotations

import random

import pytest

from lumo.config import TreeConfig
from lumo.engine.tree import GDN_FORK, GDN_NODE, GDN_WRITE, accept, build_tree, chain_config, gdn_schedule


def test_default_tree_shape():
    t = build_tree(TreeConfig())
    assert (t.n_nodes, t.rows, t.n_paths) == (28, 32, 17)
    # spine-contiguous: node i at depth i for i <= D
    assert t.depth[:12].tolist() == list(range(12))
    assert t.parent[1:12].tolist() == list(range(11))
    # siblings: children of spine nodes, shallowest first, leaves
    for i in range(12, 28):
        p = int(t.parent[i])
        assert p < 12 and int(t.depth[i]) == p + 1 and t.children(i) == []
    assert not t.valid[28:].any() and (t.owner[28:] == -1).all()
    # GDN verifier: one walking path (root .. spine node D-1), every node evaluated once
    assert t.gdn_items.shape == (1, 28) and t.gdn_items_len.tolist() == [28]
    walked = [it & GDN_NODE for it in t.gdn_items[0].tolist() if not it & GDN_FORK]
    assert walked == list(range(11))
    # balanced: its 17 forks spread over 4 rows of at most 12 items (the walk plus the last spine node, the
    # least possible), or 3 rows of at most 14; the first row walks the whole path
    parent = t.parent[:28].tolist()
    for max_rows, lens in ((4, [12, 12, 12, 9]), (64, [12, 12, 12, 9]), (3, [14, 13, 12]), (1, [28])):
        items, items_len = gdn_schedule(parent, max_rows)
        assert items_len.tolist() == lens and items.shape == (len(lens), max(lens))
        assert [it & GDN_NODE for it in items[0].tolist() if not it & GDN_FORK] == list(range(11))


@pytest.mark.parametrize(
    "cfg", [TreeConfig(), TreeConfig(depth=4, topk=4, budget=10, rows=16), chain_config(5)]
)
def test_buffers_are_consistent(cfg):
    t = build_tree(cfg)
    for i in range(t.n_nodes):
        # ancestor mask = the chain of parents, self included
        chain, u = 0, i
        while u >= 0:
            chain |= 1 << u
            u = int(t.parent[u])
        assert int(t.anc[i]) == chain
        # the owning path passes through the node
        p = int(t.owner[i])
        assert i in t.paths[p, : int(t.path_len[p])].tolist()
    # every path runs root -> leaf along parent links
    for p in range(t.n_paths):
        nodes = t.paths[p, : int(t.path_len[p])].tolist()
        assert nodes[0] == 0 and t.children(nodes[-1]) == []
        assert all(int(t.parent[b]) == a for a, b in zip(nodes, nodes[1:], strict=False))
    # each node is owned by exactly one path
    assert sorted(set(t.owner[: t.n_nodes].tolist())) == list(range(t.n_paths))


def test_accept_walk():
    t = build_tree(TreeConfig(depth=3, topk=2, budget=5, rows=8))
    # nodes: 0 root, 1..3 spine, 4 sibling at depth 1 (child of 0), 5 sibling at depth 2 (child of 1)
    tokens = [100, 11, 12, 13, 21, 22, 0, 0]
    # target agrees with the spine twice, then wants something else
    assert accept(t, tokens, [11, 12, 99, 98, 0, 0, 0, 0]) == ([0, 1, 2], 99)
    # target prefers the depth-1 sibling, then continues from it with its own choice
    assert accept(t, tokens, [21, 0, 0, 0, 55, 0, 0, 0]) == ([0, 4], 55)
    # sibling at depth 2
    assert accept(t, tokens, [11, 22, 0, 0, 0, 7, 0, 0]) == ([0, 1, 5], 7)
    # nothing accepted: the pending token is the target's choice at the root
    assert accept(t, tokens, [5, 0, 0, 0, 0, 0, 0, 0]) == ([0], 5)
    # whole spine accepted: bonus token from the leaf
    assert accept(t, tokens, [11, 12, 13, 77, 0, 0, 0, 0]) == ([0, 1, 2, 3], 77)


def test_bad_tree_configs():
    with pytest.raises(ValueError, match="budget"):
        build_tree(TreeConfig(depth=5, budget=3))
    with pytest.raises(ValueError, match="rows"):
        build_tree(TreeConfig(depth=11, topk=3, budget=27, rows=16))
    with pytest.raises(ValueError, match=r"80 nodes \(\+ the root\) needs 88 verify rows, at most 64"):
        build_tree(TreeConfig(depth=30, topk=3, budget=80, rows=88))


def random_parents(seed: int) -> list[int]:
    """Any tree whose parents precede their children (not only spine + siblings)."""
    rng = random.Random(seed)
    n = rng.randrange(2, 40)
    return [-1] + [rng.randrange(max(0, i - rng.choice([1, 3, i])), i) for i in range(1, n)]


def ancestry_of(parent: list[int], u: int) -> list[int]:
    out = []
    while u >= 0:
        out.append(u)
        u = parent[u]
    return out[::-1]


def tree_parents(cfg: TreeConfig) -> list[int]:
    t = build_tree(cfg)
    return t.parent[: t.n_nodes].tolist()


SCHEDULE_CASES = [
    tree_parents(TreeConfig()),
    tree_parents(TreeConfig(depth=4, topk=4, budget=10, rows=16)),
    tree_parents(chain_config(5)),
    [-1],  # root only: the root is walked and written, nothing forks
    [-1, 0, 0, 0],  # a root with leaf children only
    [-1, 0, 1, 1, 0, 4, 4, 2],
    *(random_parents(s) for s in range(8)),
]


@pytest.mark.parametrize("max_rows", [None, 3, 64], ids=["paths", "rows3", "rows64"])
@pytest.mark.parametrize("parent", SCHEDULE_CASES, ids=[f"case{i}" for i in range(len(SCHEDULE_CASES))])
def test_gdn_schedule(parent, max_rows):
    n = len(parent)
    items, items_len = gdn_schedule(parent, max_rows)
    kids = [[c for c in range(n) if parent[c] == u] for u in range(n)]
    walking = {u for u in range(n) if kids[u] or parent[u] < 0}
    ends = [u for u in sorted(walking) if not any(c in walking for c in kids[u])]
    assert items.shape[1] == int(items_len.max())
    if max_rows is not None:
        assert items.shape[0] <= max(max_rows, len(ends))
        # with room enough, the least critical path: the walk to a node plus its leaf children
        least = max(len(ancestry_of(parent, u)) + sum(c not in walking for c in kids[u]) for u in walking)
        assert items.shape[1] >= least and (max_rows < 64 or items.shape[1] == least)
    written = [0] * n
    lasts = []  # the last node each row walks
    for p in range(items.shape[0]):
        row = items[p].tolist()
        k = int(items_len[p])
        assert all(x == -1 for x in row[k:]), "padding past the end"
        stack: list[int] = []  # the nodes the row's state has stepped, root first
        for it in row[:k]:
            u = it & GDN_NODE
            assert it >= 0 and it & ~(GDN_NODE | GDN_FORK | GDN_WRITE) == 0 and u < n
            written[u] += bool(it & GDN_WRITE)
            if it & GDN_FORK:
                # a leaf forked off its parent, which this row has just stepped
                assert kids[u] == [] and stack[-1] == parent[u]
                assert it & GDN_WRITE and stack + [u] == ancestry_of(parent, u)
            else:
                stack.append(u)
                assert u in walking and stack == ancestry_of(parent, u)  # parent stepped before the child
        lasts.append(stack[-1])
    if max_rows is None:  # a row per walking path, walked to its end
        assert lasts == ends
    assert set(ends) <= set(lasts), "every walking path is walked to its end"
    assert written == [1] * n, "every node written exactly once"


def test_gdn_schedule_rejects_unordered_parents():
    with pytest.raises(ValueError, match="precede"):
        gdn_schedule([-1, 2, 0])
    with pytest.raises(ValueError, match="precede"):
        gdn_schedule([0])
