"""The draft tree as data: a TreeConfig turns once into index buffers (DESIGN.md, speculative event).

Shape: node 0 is the root (the pending token). The spine is the MTP's top-1 chain, node i at depth i
for i = 1..D. Siblings are the next-best MTP tokens at a spine depth: a sibling at depth j is a child of
spine node j-1 and a leaf. Siblings fill the node budget from the shallowest depth down (a shallow
node is reached more often). Rows are spine first, then siblings by (depth, rank), then padding.
The GDN verifier's schedule (`gdn_schedule`) works for any tree whose parents precede their children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TreeConfig

# gdn_items flag bits (gdn_tree.cu defines the same values): FORK = step a copy of the tile and keep the
# path's state (a leaf forked off its parent), WRITE = write o for this node. The low bits are the node id.
GDN_FORK, GDN_WRITE = 1 << 30, 1 << 29
GDN_NODE = GDN_WRITE - 1


@dataclass(frozen=True)
class TreeBuffers:
    n_nodes: int  # real nodes, root included (<= rows)
    rows: int  # padded row count of a verify
    depth_max: int  # D
    parent: torch.Tensor  # [rows] int32, -1 for the root and padding
    depth: torch.Tensor  # [rows] int32, 0 for root and padding
    rank: torch.Tensor  # [rows] int32: 0 spine, r = r-th best MTP candidate at its depth, -1 padding
    anc: (
        torch.Tensor
    )  # [rows] int64 bitmask: bit j set iff node j is an ancestor of the row or the row itself
    paths: torch.Tensor  # [P, D+1] int32 root-to-leaf node ids, -1 past the leaf
    path_len: torch.Tensor  # [P] int32 nodes on each path
    owner: torch.Tensor  # [rows] int32: the first path through this node (-1 padding)
    valid: torch.Tensor  # [rows] bool
    gdn_items: torch.Tensor  # [P', L'] int32 gdn_tree's items per schedule row (gdn_schedule), -1 padded
    gdn_items_len: torch.Tensor  # [P'] int32 items of each row

    @property
    def n_paths(self) -> int:
        return self.paths.shape[0]

    def children(self, node: int) -> list[int]:
        return [i for i in range(self.n_nodes) if int(self.parent[i]) == node]

    def path_nodes(self) -> torch.Tensor:
        """[rows, D] int32: row i's path below the root (its ancestors but the root, then i), -1 padded; a
        padding row has none. The tokens these nodes carry are the ones a verify row's sample has seen
        generated beyond the committed ones (the root is the pending token: already counted)."""
        out = torch.full((self.rows, self.depth_max), -1, dtype=torch.int32)
        for i in range(self.n_nodes):
            nodes = [j for j in range(1, self.rows) if int(self.anc[i]) >> j & 1]
            out[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.int32)
        return out


def sibling_depths(cfg: TreeConfig) -> list[tuple[int, int]]:
    """(depth, rank) of every sibling, shallowest first, as many as the budget allows."""
    out = []
    for d in range(1, cfg.depth + 1):
        for r in range(1, cfg.topk):
            out.append((d, r))
    return out[: max(cfg.budget - cfg.depth, 0)]


def gdn_schedule(parent: list[int], max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN tree verifier's work list: (items [P', L'] int32, -1 padded; items_len [P'] int32), one row
    per warp walk (gdn_tree.cu runs the rows in parallel, each item one gdn_step in sequence).

    parent: one entry per real node (-1 for a root), every parent before its children. The walking
    paths are the root-to-leaf paths of the tree with its leaves removed (a root-only tree keeps its
    root); each walking node is owned by the first walking path through it, in order of the paths' last
    nodes. A leaf is not walked: a walk through its parent forks it (one step on a copy of the parent's
    state, which the walk keeps). A row's items, in order: for each node u it walks, u (WRITE if it is the
    first row of u's owning path), then the leaf children of u it forks, as c | FORK | WRITE. So every node
    is written exactly once, with the state after its own root-to-node path, and a parent is always
    stepped before its children.

    Without `max_rows` a walking path is one row (it forks all its leaves): the default spine + siblings
    tree gives one row of 28 items (11 walked nodes, 17 forks). A row is a warp's critical path, so with
    `max_rows` the forks of a walking path are spread over several rows, at most max(max_rows, walking
    paths) in all: the first walks the whole path and forks from its deepest node upwards while its length
    stays within a bound T; each further row walks the path only down to the deepest node whose forks it
    takes (without writing the walked nodes: recomputed, the same bits) and takes forks upwards the same
    way. T is the least bound that keeps to the row count, at least the longest walk to a node plus that
    node's forks, which no schedule can undercut. The default tree gives 4 rows of at most 12 items with
    max_rows 4 (45 steps in all), 3 rows of at most 14 with max_rows 3."""
    n = len(parent)
    if any(not -1 <= p < i for i, p in enumerate(parent)):
        raise ValueError(f"parents must precede their children (parent[i] < i or -1), got {parent}")
    kids: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parent):
        if p >= 0:
            kids[p].append(i)
    walked = [bool(kids[u]) or parent[u] < 0 for u in range(n)]
    ends = [u for u in range(n) if walked[u] and not any(walked[c] for c in kids[u])]
    paths = []  # per walking path, root first: (node, owned by this path, the leaves it forks)
    owner = [-1] * n
    for p, end in enumerate(ends):
        nodes, u = [], end
        while u >= 0:
            nodes.append(u)
            u = parent[u]
        path = []
        for u in reversed(nodes):
            own = owner[u] < 0
            if own:
                owner[u] = p
            path.append((u, own, [c for c in kids[u] if not walked[c]] if own else []))
        paths.append(path)
    if max_rows is None:
        rows = _rows(paths, n)  # a bound of n never splits a path
    else:  # no bound below the longest walk to a node plus its forks fits
        least = max((i + 1 + len(f) for path in paths for i, (_, _, f) in enumerate(path)), default=0)
        rows = next(r for t in range(least, n + 1) if len(r := _rows(paths, t)) <= max(max_rows, len(paths)))
    L = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), L), -1, dtype=torch.int32)
    for p, items in enumerate(rows):
        out[p, : len(items)] = torch.tensor(items, dtype=torch.int32)
    return out, torch.tensor([len(r) for r in rows], dtype=torch.int32)


def _rows(paths: list[list[tuple[int, bool, list[int]]]], bound: int) -> list[list[int]]:
    """gdn_schedule's rows for item bound `bound` (>= every walk to a node plus its forks)."""
    rows = []
    for path in paths:
        groups = [(len(path), set())]  # per row: (nodes it walks, the positions whose forks it takes)
        load = 0  # forks the last row takes
        for i in reversed(range(len(path))):
            forks = path[i][2]
            if forks and groups[-1][0] + load + len(forks) > bound:
                groups.append((i + 1, set()))  # fits: i + 1 + len(forks) <= bound
                load = 0
            if forks:
                groups[-1][1].add(i)
                load += len(forks)
        for r, (walk, takes) in enumerate(groups):
            items = []
            for i, (u, own, forks) in enumerate(path[:walk]):
                items.append(u | (GDN_WRITE if own and r == 0 else 0))
                if i in takes:
                    items += [c | GDN_FORK | GDN_WRITE for c in forks]
            rows.append(items)
    return rows


def build_tree(cfg: TreeConfig) -> TreeBuffers:
    if cfg.depth < 1 or cfg.topk < 1:
        raise ValueError("tree depth and topk must be at least 1")
    if cfg.budget < cfg.depth:
        raise ValueError(f"tree budget {cfg.budget} is smaller than its spine depth {cfg.depth}")
    sibs = sibling_depths(cfg)
    n = 1 + cfg.depth + len(sibs)
    if cfg.rows > 64:
        raise ValueError(
            f"a draft tree of {n - 1} nodes (+ the root) needs {cfg.rows} verify rows, at most 64 fit: lower "
            "its budget or depth (--spec-budget, --spec-depth)"
        )
    if n > cfg.rows:
        raise ValueError(f"tree of {n} nodes does not fit {cfg.rows} rows")
    R = cfg.rows
    parent = [-1] * R
    depth = [0] * R
    rank = [-1] * R
    rank[0] = 0
    for i in range(1, cfg.depth + 1):
        parent[i], depth[i], rank[i] = i - 1, i, 0
    for j, (d, r) in enumerate(sibs):
        i = 1 + cfg.depth + j
        parent[i], depth[i], rank[i] = d - 1, d, r  # child of spine node d-1
    anc = [0] * R
    for i in range(n):
        a, u = 0, i
        while u >= 0:
            a |= 1 << u
            u = parent[u]
        anc[i] = a
    # Paths: the spine first, then one per sibling leaf; every node is owned by the first path through it.
    leaves = [cfg.depth] + [1 + cfg.depth + j for j in range(len(sibs))]
    paths = torch.full((len(leaves), cfg.depth + 1), -1, dtype=torch.int32)
    path_len = torch.zeros(len(leaves), dtype=torch.int32)
    owner = [-1] * R
    for p, leaf in enumerate(leaves):
        nodes, u = [], leaf
        while u >= 0:
            nodes.append(u)
            u = parent[u]
        nodes.reverse()
        paths[p, : len(nodes)] = torch.tensor(nodes, dtype=torch.int32)
        path_len[p] = len(nodes)
        for u in nodes:
            if owner[u] < 0:
                owner[u] = p
    i32 = dict(dtype=torch.int32)
    items, items_len = gdn_schedule(parent[:n])
    return TreeBuffers(
        n_nodes=n,
        rows=R,
        depth_max=cfg.depth,
        parent=torch.tensor(parent, **i32),
        depth=torch.tensor(depth, **i32),
        rank=torch.tensor(rank, **i32),
        anc=torch.tensor(anc, dtype=torch.int64),
        paths=paths,
        path_len=path_len,
        owner=torch.tensor(owner, **i32),
        valid=torch.arange(R) < n,
        gdn_items=items,
        gdn_items_len=items_len,
    )


def chain_config(depth: int) -> TreeConfig:
    """A chain is a tree with no siblings."""
    return TreeConfig(depth=depth, topk=1, budget=depth, rows=depth + 1)


def accept(tree: TreeBuffers, tokens: list[int], choice: list[int]) -> tuple[list[int], int]:
    """The acceptance rule. tokens[i]: the token node i carries; choice[i]: the target's choice at node i
    (greedy: argmax of its logits; sampling: its own seeded sample). Walk from the root: while a child of
    the current node carries the target's choice there, move to it. Returns the accepted nodes (root
    first) and the new pending token (the target's choice at the last accepted node). Every emitted token
    is the target's own choice, so greedy output equals plain greedy decoding and sampling is lossless."""
    path, u = [0], 0
    while True:
        nxt = next((c for c in tree.children(u) if tokens[c] == choice[u]), None)
        if nxt is None:
            return path, choice[u]
        path.append(nxt)
        u = nxt
