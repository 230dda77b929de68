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
from ..config import DEFAULT_PREFIX_LINES, ModelConfig, TreeConfig
from ..weights import ModelWeights
from .grammar import Constraint, bitmask_words, unpack_bitmask
from .logprobs import PromptLogprobs, ScoresTokens
from .prefix import PrefixCache
from .sampling import SamplingParams, TokenHistory, adjust, mask_logits, sample
from .tree import TreeBuffers, accept, build_tree, chain_config

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory for long prompts
MIN_CAPACITY = 4096  # smallest slot (a Slot's cache, a GPURunner): short requests share one allocation


def slot_capacity(need: int, limit: int) -> int:
    """Positions to allocate for a slot that must hold `need`: a power of two >= MIN_CAPACITY, at most
    `limit` (the model's context) unless `need` itself is larger (a tree's extra slots). Few distinct
    sizes: few re-allocations (and, on the GPU, captures)."""
    cap = MIN_CAPACITY
    while cap < need:
        cap *= 2
    return max(min(cap, limit), need)


class Slot:
    """A sequence's cache kept across requests, with its prefix cache (lumo.engine.prefix): what an LLM on
    the torch backend keeps so that a prompt sharing a prefix with an earlier one resumes after it."""

    def __init__(
        self, prefix_snapshots: int = 0, prefix_park: int = 0, prefix_lines: int = DEFAULT_PREFIX_LINES
    ):
        self.cache: M.Cache | None = None
        self.prefix = (
            PrefixCache(PREFILL_CHUNK, prefix_snapshots, prefix_park, lines=prefix_lines)
            if prefix_snapshots
            else None
        )
        self.write_ahead = 0  # positions past its length a request's decoding writes (its decoders' most)

    def cache_for(self, cfg: ModelConfig, max_len: int, device, dtype) -> M.Cache:
        """The cache (a slot serves one model on one device), replaced by a larger one (slot_capacity),
        emptying the prefix cache, when it holds fewer than max_len positions."""
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = None  # free the old one first
            self.cache = M.new_cache(cfg, slot_capacity(max_len, cfg.context_length), device, dtype)
            if self.prefix is not None:
                self.prefix.clear()
        return self.cache


class PlainDecoder(ScoresTokens):
    """One target forward per token; the native reference for exactness.

    With `logprobs` set to k (lumo.engine.logprobs; None: off), prefill / step also leave the emitted
    tokens' logprobs with their k most likely alternatives in `last_logprobs`. With `constraint` set
    (lumo.engine.grammar; before prefill) every row is masked by it and the emitted tokens advance it.
    """

    extra_positions = 0  # cache slots needed beyond prompt + output
    feeds_mtp = False  # its prefill writes the MTP head's K/V (speculative decoders)
    history: TokenHistory | None = None  # the penalties' token history (prefill sets it when params have any)
    constraint: Constraint | None = None  # a structured output's grammar state (None: unconstrained)

    def __init__(
        self,
        cfg: ModelConfig,
        w: ModelWeights,
        params: SamplingParams,
        max_len: int,
        device,
        dtype,
        slot: Slot | None = None,
    ):
        self.cfg, self.w, self.params = cfg, w, params
        self.device = device
        self.prefix = slot.prefix if slot is not None else None
        if slot is None:
            self.cache = M.new_cache(cfg, max_len + self.extra_positions, device, dtype)
        else:
            self.cache = slot.cache_for(cfg, max_len + self.extra_positions, device, dtype)
            slot.write_ahead = max(slot.write_ahead, self.extra_positions)
        self._slot = slot
        self.cached_tokens = 0  # prompt tokens the latest prefill took from the prefix cache
        self._init_scores()
        if self.prefix is not None:  # a snapshot's final-norm row is restored here
            self._restored_carry = torch.zeros(1, cfg.hidden_size, device=device, dtype=dtype)

    def _resume(self, prompt_ids: list[int]) -> int:
        """Empty the cache, or restore the state after the longest cached prefix; returns its length."""
        c = self.cache
        for t in c.gdn_state + c.conv_state:
            t.zero_()
        self._carry = None  # final-norm hidden row of the position before the next chunk
        start = 0
        if self.prefix is not None:  # owner: a plain decoder's prefills leave the MTP's K/V behind
            state = [*c.gdn_state, *c.conv_state, self._restored_carry]
            # positions [0, written) may hold what the slot's previous request wrote (a failed chunk too)
            written = min(c.max_len, c.length + max(self._slot.write_ahead, PREFILL_CHUNK))
            positions = [*c.kv_k, *c.kv_v, *c.mtp_k, *c.mtp_v]
            reuse = self.prompt_logprobs is None
            start = self.prefix.resume(prompt_ids, state, self.feeds_mtp, reuse, positions, written)
            self._carry = self._restored_carry if start else None
        c.length = c.mtp_length = start
        return start

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        """Chunks of PREFILL_CHUNK tokens on the grid of absolute positions, from the longest cached
        prefix (prefix.py: the same chunks, so the same bits, as from position 0)."""
        self.cached_tokens = start = self._resume(prompt_ids)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        c = self.cache
        scored = None if self.prompt_logprobs is None else PromptLogprobs(prompt_ids, self.prompt_logprobs)
        for s in range(start, len(prompt_ids), PREFILL_CHUNK):
            lg, h = M.forward(self.cfg, self.w, ids[None, s : s + PREFILL_CHUNK], c)
            if scored is not None:
                scored.logits(lg[0], s)
            self._after_chunk(ids, h[0], s)
            self._carry = h[0, -1:]
            if self.prefix is not None and self.prefix.wants(c.length):
                self.prefix.add(c.length, [*c.gdn_state, *c.conv_state, self._carry])
        # The penalties' history (lumo.engine.sampling): the prompt, then every emitted token.
        self.history = TokenHistory(self.cfg.vocab_size, prompt_ids) if self.params.penalized else None
        row = self._masked(lg[0, -1])
        self.pending = self._sample(row, c.length)
        self._after_prefill()
        self._note_logprobs(row[None], [self.pending])
        self.last_prompt_logprobs = [] if scored is None else scored.out
        return [self.pending]

    def _after_chunk(self, ids: torch.Tensor, hidden: torch.Tensor, start: int) -> None:
        """hidden [T, H]: the final-norm rows of prompt positions start.. (the MTP head's input)."""

    def _after_prefill(self) -> None:
        pass

    def step(self) -> list[int]:
        logits, _ = M.forward(self.cfg, self.w, self._ids([self.pending]), self.cache)
        row = self._masked(logits[0, -1])
        self.pending = self._sample(row, self.cache.length)
        self._note_logprobs(row[None], [self.pending])
        return [self.pending]

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits of the next position with the tokens the constraint refuses at -inf."""
        return logits if self.constraint is None else mask_logits(logits, self.constraint.allowed())

    def _sample(self, logits: torch.Tensor, position: int) -> int:
        """The next token (from masked logits), counted in the penalties' history and the grammar."""
        tok = sample(logits, self.params, position, self.history)
        self._emitted([tok])
        return tok

    def _emitted(self, tokens: list[int]) -> None:
        if self.history is not None:
            self.history.add(tokens)
        if self.constraint is not None:
            self.constraint.advance(tokens)

    def _ids(self, toks: list[int]) -> torch.Tensor:
        return torch.tensor([toks], dtype=torch.long, device=self.device)


@dataclass
class SpecStats:
    events: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per event
    plain_steps: int = 0  # steps taken without speculation (adaptive speculation, GPU engine)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)


class SpecDecoder(PlainDecoder):
    """Tree speculative decoding, reference implementation (exact; slow, one forward per tree node)."""

    feeds_mtp = True

    def __init__(self, cfg, w, params, max_len, device, dtype, tree: TreeConfig, draft_ids=None, slot=None):
        if w.mtp is None:
            raise ValueError("speculative decoding needs a model with an MTP head (mtp.* tensors)")
        self.tree: TreeBuffers = build_tree(tree)
        self._path_nodes = self.tree.path_nodes()  # [rows, D]: each node's path below the root
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
        super().__init__(cfg, w, params, max_len, device, dtype, slot)
        self.stats = SpecStats()

    def _after_chunk(self, ids: torch.Tensor, hidden: torch.Tensor, start: int) -> None:
        # The MTP sees the pair (h_q, x_{q+1}) of every prompt position q, chunk by chunk as the GPU engine
        # feeds it: a chunk's last row waits for the next chunk's first token (the carry).
        rows = hidden[:-1] if self._carry is None else torch.cat([self._carry, hidden[:-1]])
        q0 = start if self._carry is None else start - 1
        if rows.shape[0]:
            self._feed_mtp(rows, ids[q0 + 1 : q0 + 1 + rows.shape[0]].tolist(), q0)

    def _after_prefill(self) -> None:
        # The last prompt position pairs the pending token; its output is the first draft step's input.
        self._feed_mtp(self._carry, [self.pending], self.cache.length - 1)

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
        # and under a structured output's grammar, its state walked along the spine
        grammar = None if self.constraint is None else self.constraint.spine()
        for d in range(1, t.depth_max + 1):
            k = max(int(t.rank.max()) + 1, 1)
            if self.params.logit_bias or self.history is not None:
                # the drafter proposes under the bias and the penalties (the spine so far generated)
                spine = None if self.history is None else self.history.with_tokens(tokens[1:d])
                logits = adjust(logits, self.params, spine)
            bits = None if grammar is None else grammar.draft_bitmask()
            if bits is not None:
                logits = mask_logits(logits, unpack_bitmask(bits, self.cfg.vocab_size))
            elif grammar is not None and not grammar.reasoning:
                grammar = None  # the grammar fails here: plain decoding would too, should it get here
            if self.draft_ids is None:
                top = torch.topk(logits, k).indices.tolist()
            else:
                top = self.draft_ids[torch.topk(logits[self.draft_ids], k).indices].tolist()
            for i in range(t.n_nodes):
                if int(t.depth[i]) == d:
                    tokens[i] = top[int(t.rank[i])]
            if grammar is not None and not grammar.try_advance(tokens[d]):
                grammar = None  # a spine the grammar refuses: no verify row below it is reached anyway
            if d < t.depth_max:
                lg, out = M.mtp_forward(
                    self.cfg, self.w, hidden[None], self._ids([tokens[d]]), self.cache, pos
                )
                logits, hidden, pos = lg[0, -1], out[0], pos + 1
        return tokens

    def _choice(self, logits: torch.Tensor, position: int, node: int, tokens: list[int]) -> int:
        """The target's choice at tree node `node`: its sample sees the drafted tokens on its path as
        generated (plain decoding has generated exactly those when it samples at that position)."""
        history = self.history
        if history is not None:
            history = history.with_tokens(tokens[j] for j in self._path_nodes[node].tolist() if j >= 0)
        return sample(logits, self.params, position, history)

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
        if self.constraint is not None:  # each row masked with the grammar's state after its path
            bits = torch.empty(t.n_nodes, bitmask_words(self.cfg.vocab_size), dtype=torch.int32)
            on = self.constraint.tree_bitmasks(tokens[: t.n_nodes], t.parent[: t.n_nodes].tolist(), bits)
            for i in range(t.n_nodes):
                if on[i]:
                    logits[i] = mask_logits(logits[i], unpack_bitmask(bits[i], self.cfg.vocab_size))
        choice = [0] * t.rows
        for i in range(t.n_nodes):
            choice[i] = self._choice(logits[i], L + int(t.depth[i]) + 1, i, tokens)
        path, pending = accept(t, tokens, choice)
        # Commit: the state after the last accepted node is exactly plain decoding's state.
        M.restore(c, state[path[-1]])
        self.pending = pending
        emitted = [tokens[i] for i in path[1:]] + [pending]
        self._emitted(emitted)
        self._feed_mtp(torch.cat([hidden[i] for i in path]), emitted, L)
        self.stats.events += 1
        self.stats.accepted.append(len(path) - 1)
        self._note_logprobs(torch.stack([logits[i] for i in path]), emitted)  # node path[j] chose emitted[j]
        return emitted


def make_decoder(
    cfg,
    w,
    params,
    max_len,
    device,
    dtype,
    spec: str,
    tree: TreeConfig | None = None,
    draft_ids=None,
    slot: Slot | None = None,
):
    if spec == "off":
        return PlainDecoder(cfg, w, params, max_len, device, dtype, slot)
    if spec == "chain":
        chain = chain_config((tree or TreeConfig()).depth)
        return SpecDecoder(cfg, w, params, max_len, device, dtype, chain, draft_ids, slot)
    if spec == "tree":
        return SpecDecoder(cfg, w, params, max_len, device, dtype, tree or TreeConfig(), draft_ids, slot)
    raise ValueError(f"unknown spec mode {spec!r}: use tree, chain or off")
