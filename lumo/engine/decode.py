"""Decoders over the reference model: plain (one target forward per token) and speculative (MTP tree).

Both expose `prefill(prompt_ids) -> [first token]` and `step() -> [tokens]`, so the generation loop does
not care which one runs. The speculative decoder here is the plain-torch reference of the whole event
(DESIGN.md, 'The speculative event in detail'): it is exact by construction, since every tree node is
evaluated by the same single-token forward plain decoding runs, on a snapshot of the committed state.
The GPU engine (path-parallel verify) is tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import model as M
from ..config import ModelConfig, TreeConfig
from ..weights import ModelWeights
from .sampling import SamplingParams, sample
from .tree import TreeBuffers, accept, build_tree, chain_config

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory for long prompts


class PlainDecoder:
    """One target forward per token; the native reference for exactness."""

    extra_positions = 0  # cache slots needed beyond prompt + output

    def __init__(
        self, cfg: ModelConfig, w: ModelWeights, params: SamplingParams, max_len: int, device, dtype
    ):
        self.cfg, self.w, self.params = cfg, w, params
        self.device = device
        self.cache = M.new_cache(cfg, max_len + self.extra_positions, device, dtype)

    def _prefill_forward(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        logits, hidden = [], []
        for s in range(0, len(prompt_ids), PREFILL_CHUNK):
            lg, h = M.forward(self.cfg, self.w, ids[None, s : s + PREFILL_CHUNK], self.cache)
            logits.append(lg[0, -1])
            hidden.append(h[0])
        return logits[-1], torch.cat(hidden)

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        last_logits, hidden = self._prefill_forward(prompt_ids)
        self.pending = sample(last_logits, self.params, position=self.cache.length)
        self._after_prefill(prompt_ids, hidden)
        return [self.pending]

    def _after_prefill(self, prompt_ids: list[int], hidden: torch.Tensor) -> None:
        pass

    def step(self) -> list[int]:
        logits, _ = M.forward(self.cfg, self.w, self._ids([self.pending]), self.cache)
        self.pending = sample(logits[0, -1], self.params, position=self.cache.length)
        return [self.pending]

    def _ids(self, toks: list[int]) -> torch.Tensor:
        return torch.tensor([toks], dtype=torch.long, device=self.device)


@dataclass
class SpecStats:
    events: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per event

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)


class SpecDecoder(PlainDecoder):
    """Tree speculative decoding, reference implementation (exact; slow, one forward per tree node)."""

    def __init__(self, cfg, w, params, max_len, device, dtype, tree: TreeConfig, draft_ids=None):
        if w.mtp is None:
            raise ValueError("speculative decoding needs a model with an MTP head (mtp.* tensors)")
        self.tree: TreeBuffers = build_tree(tree)
        # A draft vocabulary (lumo.engine.draft_vocab): the drafter's top-k among these token ids only (the
        # full lm_head is still computed here; the kernels backend computes only these rows).
        self.draft_ids = None
        if draft_ids is not None:
            self.draft_ids = torch.as_tensor(draft_ids, dtype=torch.long, device=device)
            if self.draft_ids.numel() < int(self.tree.rank.max()) + 1:
                raise ValueError(
                    f"a draft vocabulary of {self.draft_ids.numel()} tokens is smaller than the tree's top-k"
                )
        self.extra_positions = self.tree.depth_max + 1
        super().__init__(cfg, w, params, max_len, device, dtype)
        self.stats = SpecStats()

    def _after_prefill(self, prompt_ids: list[int], hidden: torch.Tensor) -> None:
        # The MTP sees the pair (h_q, x_{q+1}) of every prompt position q; the last pairs the pending token.
        self._feed_mtp(hidden, prompt_ids[1:] + [self.pending], 0)

    def _feed_mtp(self, hidden: torch.Tensor, next_tokens: list[int], start: int) -> None:
        """MTP K/V for committed positions start.. ; the last pair's output is the next draft's first step."""
        logits, out = M.mtp_forward(self.cfg, self.w, hidden[None], self._ids(next_tokens), self.cache, start)
        self.draft_logits, self.draft_hidden = logits[0, -1], out[0, -1:]

    def _draft(self) -> list[int]:
        """Tokens carried by the tree's nodes (node 0 = pending): the MTP's top-k along its spine."""
        t = self.tree
        tokens = [0] * t.rows
        tokens[0] = self.pending
        logits, hidden = self.draft_logits, self.draft_hidden
        pos = self.cache.length  # MTP position of the step predicting depth 2 (pair (out_1, s_1))
        for d in range(1, t.depth_max + 1):
            k = max(int(t.rank.max()) + 1, 1)
            if self.draft_ids is None:
                top = torch.topk(logits, k).indices.tolist()
            else:
                top = self.draft_ids[torch.topk(logits[self.draft_ids], k).indices].tolist()
            for i in range(t.n_nodes):
                if int(t.depth[i]) == d:
                    tokens[i] = top[int(t.rank[i])]
            if d < t.depth_max:
                lg, out = M.mtp_forward(
                    self.cfg, self.w, hidden[None], self._ids([tokens[d]]), self.cache, pos
                )
                logits, hidden, pos = lg[0, -1], out[0], pos + 1
        return tokens

    def _choice(self, logits: torch.Tensor, position: int) -> int:
        return sample(logits, self.params, position=position)

    def step(self) -> list[int]:
        t, L = self.tree, self.cache.length
        tokens = self._draft()
        # Verify: walk the spine token by token from the committed state, snapshotting before each node;
        # a sibling at depth j runs from the snapshot taken after spine nodes 0..j-1.
        D = t.depth_max
        c, lo, hi = self.cache, L, L + D + 1  # tree nodes write K/V only at positions lo..hi-1
        state = {}  # node -> snapshot of the cache after the path root..node
        before = {}  # spine depth j -> snapshot after spine nodes 0..j-1 (j >= 1)
        logits, hidden = [None] * t.rows, [None] * t.rows
        for i in range(D + 1):
            if i > 0:
                before[i] = state[i - 1] = M.snapshot(c, lo, hi)
            lg, h = M.forward(self.cfg, self.w, self._ids([tokens[i]]), c)
            logits[i], hidden[i] = lg[0, -1], h[0]
        state[D] = M.snapshot(c, lo, hi)
        for i in range(D + 1, t.n_nodes):
            M.restore(c, before[int(t.depth[i])])
            lg, h = M.forward(self.cfg, self.w, self._ids([tokens[i]]), c)
            logits[i], hidden[i] = lg[0, -1], h[0]
            state[i] = M.snapshot(c, lo, hi)
        choice = [0] * t.rows
        for i in range(t.n_nodes):
            choice[i] = self._choice(logits[i], L + int(t.depth[i]) + 1)
        path, pending = accept(t, tokens, choice)
        # Commit: the state after the last accepted node is exactly plain decoding's state.
        M.restore(c, state[path[-1]])
        self.pending = pending
        emitted = [tokens[i] for i in path[1:]] + [pending]
        self._feed_mtp(torch.cat([hidden[i] for i in path]), emitted, L)
        self.stats.events += 1
        self.stats.accepted.append(len(path) - 1)
        return emitted


def make_decoder(
    cfg, w, params, max_len, device, dtype, spec: str, tree: TreeConfig | None = None, draft_ids=None
):
    if spec == "off":
        return PlainDecoder(cfg, w, params, max_len, device, dtype)
    if spec == "chain":
        chain = chain_config((tree or TreeConfig()).depth)
        return SpecDecoder(cfg, w, params, max_len, device, dtype, chain, draft_ids)
    if spec == "tree":
        return SpecDecoder(cfg, w, params, max_len, device, dtype, tree or TreeConfig(), draft_ids)
    raise ValueError(f"unknown spec mode {spec!r}: use tree, chain or off")
