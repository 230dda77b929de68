from __future__ import annotations

import pytest

from lumo.config import TreeConfig
from lumo.engine.tree import accept, build_tree, chain_config


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
