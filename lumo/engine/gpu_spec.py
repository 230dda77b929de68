"""Tree speculative decoding on the GPU kernels (DESIGN.md, 'The speculative event in detail').

`GPUSpecEngine` owns the static buffers of one (runner, tree shape) pair and runs an event as three
launch sequences, each capturable as a CUDA graph (every per-event value lives in a device buffer):
  draft          the MTP head walks the spine (D - 1 one-row steps); after each step `topk_select` writes
                 the spine token and its siblings into the tree's token buffer (draft_node_table); for a
                 request with a grammar the same steps in 2D - 1 pieces (graphs of their own), each
                 selection under the grammar's state after the spine so far (a host sync per depth);
  verify         one target forward over the R tree rows (linears at M = R, conv_gather_qk over conv_pred,
                 which also normalises q and k once per row and head, gdn_tree, attention with ancestor
                 masks), final norm + lm_head for all rows, a structured output's masks (apply_token_mask:
                 for a request with a grammar the host computes them while the GPU runs the forward,
                 which is then a graph of its own, and the masking and sampling another), then
                 sample_tokens per row at absolute position len + depth + 1;
  accept+commit  tree_accept -> GDN replay (gdn_decode rows/count over the recorded operands) ->
                 conv_state_commit -> kv_remap (reads the old len) -> MTP fed the accepted pairs
                 (its K/V and the next event's first draft logits) -> len += count, pending -> root.
Then one device-to-host copy of tree_accept's result (count, pending, emitted tokens).

Exactness: every kernel is batch invariant, so an accepted node's logits, the committed GDN / conv state
and the K/V are bitwise those of plain decoding (GPUDecoder) at the same position, and so are the tokens
(greedy and seeded sampling). decode.SpecDecoder is the plain-torch reference of the same event.
The runner's own decode state (tok, pos, sample_pos) is kept current after every event, so plain
`runner.decode_step()` may continue where speculation stopped; `plain_step()` does so and also feeds the
MTP its pair (a fourth graph), so that adaptive speculation (lumo.engine.adaptive) can switch between
events and plain steps at any token with the same output.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from ..config import FULL, TreeConfig
from ..kernels.attention import attn_decode, attn_decode_workspace, attn_prefill
from ..kernels.conv import conv_gather_qk, conv_pred, conv_state_commit
from ..kernels.gdn import gdn_decode
from ..kernels.gdn_tree import gdn_tree, gdn_tree_rows
from ..kernels.norms import gated_rmsnorm, rmsnorm1p
from ..kernels.rope_kv import qk_norm_rope_kv
from ..kernels.sampling import Penalties, sample_tokens, sample_workspace
from ..kernels.token_mask import apply_token_mask
from ..kernels.tree_ops import draft_node_table, kv_remap, kv_table, topk_select, topk_workspace, tree_accept
from .adaptive import AdaptiveSpec
from .decode import SpecStats
from .gpu_decode import GPUBackend
from .gpu_weights import GPUGDN, SMALL_M, GPUAttn, GPULayer, swiglu, swiglu_scratch
from .grammar import Constraint, bitmask_words
from .logprobs import PromptLogprobs, ScoresTokens
from .runner import GPURunner, beside, join
from .sampling import SamplingParams
from .tree import TreeBuffers, build_tree, chain_config, gdn_schedule

_NO_SLOT = -(1 << 30)  # slot offset of a padding row: len + offset < 0, so qk_norm_rope_kv skips it
EVENT_PHASES = ("draft", "verify", "commit")  # an event's graphs, replayed in this order


def _capture(steps: dict[str, Callable[[], None]]) -> dict[str, torch.cuda.CUDAGraph]:
    """Each launch sequence recorded as a CUDA graph (nothing runs: warm the kernels first)."""
    graphs = {}
    for name, fn in steps.items():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # records only
            fn()
        graphs[name] = g
    return graphs


class _Rows:
    """Static activations of T rows through decoder layers (target verify: T = R; MTP: T = 1 or D + 1)."""

    def __init__(self, runner: GPURunner, T: int):
        cfg, dev, bf = runner.cfg, runner.device, torch.bfloat16
        H, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.T = T
        self.h = torch.zeros(T, H, dtype=bf, device=dev)  # residual stream
        self.x = torch.zeros(T, H, dtype=bf, device=dev)  # normed block input
        self.delta = torch.zeros(T, H, dtype=bf, device=dev)  # block output
        self.out = torch.zeros(T, H, dtype=bf, device=dev)  # final-norm output
        self.attn_proj = torch.zeros(T, nh * 2 * d + 2 * nkv * d, dtype=bf, device=dev)
        self.qg, self.k, self.v = runner._attn_views(self.attn_proj, T)
        self.q = torch.zeros(T, nh, d, dtype=bf, device=dev)
        self.attn_out = torch.zeros(T, nh, d, dtype=bf, device=dev)
        self.attn_ws = attn_decode_workspace(T, nh, d, runner.max_len, dev)
        layers = runner.w.layers + (runner.w.mtp.layers if runner.w.mtp is not None else [])
        self.mlp_scratch = swiglu_scratch(layers, T, dev)  # the gate+up GEMV's rows, if not fused
        self.act = torch.zeros(T, I, dtype=bf, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int32, device=dev)  # RoPE positions
        self.slots = torch.zeros(T, dtype=torch.int32, device=dev)  # KV cache slots
        self.mask = torch.ones(T, dtype=torch.int64, device=dev)  # ancestor bits over slots len..


class GPUSpecEngine:
    """Buffers, launch sequences and graphs of tree speculation for one runner and one tree shape."""

    def __init__(self, runner: GPURunner, tree: TreeConfig):
        w = runner.w
        if w.mtp is None:
            raise ValueError(
                "speculative decoding needs the MTP head packed: pack_weights(cfg, w, device, mtp=True)"
            )
        self.runner, self.cfg, self.w, self.dev = runner, runner.cfg, w, runner.device
        self.tb: TreeBuffers = build_tree(tree)
        tb, cfg, dev = self.tb, self.cfg, self.dev
        R, D = tb.rows, tb.depth_max
        self.R, self.D, self.cap = R, D, D + 1  # cap: accepted nodes at most (root + D drafts)
        self.cached_tokens = 0  # prompt tokens the latest prefill took from the runner's prefix cache
        self._prefix_owner = object()  # this engine's token in the runner's prefix cache (its MTP K/V)
        runner.write_ahead = max(runner.write_ahead, R + self.cap)  # an event's tree slots past the length
        self.k = int(tb.rank.max()) + 1  # MTP candidates per depth
        if R > SMALL_M:
            raise ValueError(f"a tree of {R} rows exceeds the {SMALL_M} rows of the batch-invariant GEMV")
        if runner.max_len < R + 2:
            raise ValueError(f"runner of {runner.max_len} positions is too small for a tree of {R} rows")
        i32, i64, f32, bf = torch.int32, torch.int64, torch.float32, torch.bfloat16
        H, V = cfg.hidden_size, cfg.vocab_size
        nv, dv, C, K = (
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.conv_dim,
            cfg.linear_conv_kernel_dim,
        )
        n_gdn = cfg.num_layers - len(cfg.full_attention_layers)

        # ---- tree index buffers (device, built once) ----
        self.parent = tb.parent.to(dev)
        self.depth = tb.depth.to(dev)
        self.depth1 = (tb.depth.long() + 1).to(dev)  # [R] i64: sampling position offset
        self.pred = conv_pred(tb.parent.tolist(), K).to(dev)  # [R, K-1]: padding rows act as roots
        self.gdn_items, self.gdn_items_len = (t.to(dev) for t in self._gdn_schedule())  # [P', L'], [P']
        self.table = draft_node_table(tb, self.k).to(dev)  # [D, k] node of (depth, rank)
        off = torch.where(tb.valid, torch.arange(R, dtype=i32), torch.full((R,), _NO_SLOT, dtype=i32))
        self.slot_off = off.to(dev)  # [R] i32: row i -> tree slot len + i

        # ---- per-event device values ----
        self.tokens = torch.zeros(R, dtype=i32, device=dev)  # [R] node tokens; [0] = pending
        self.choice = torch.zeros(R, dtype=i32, device=dev)  # [R] the target's choice per node
        self.sample_pos = torch.zeros(R, dtype=i64, device=dev)  # [R] len + depth + 1
        self.len64 = torch.zeros(1, dtype=i64, device=dev)
        self.accepted = torch.full((self.cap,), -1, dtype=i32, device=dev)  # node ids root first
        self.result = torch.full((self.cap + 2,), -1, dtype=i32, device=dev)  # n, pending, emitted
        self.feed_start = torch.zeros(1, dtype=i32, device=dev)  # first MTP position of a feed
        self.feed_idx = torch.zeros(self.cap, dtype=i32, device=dev)
        self.last_idx = torch.zeros(1, dtype=i32, device=dev)
        self.mtp_pos = torch.zeros(1, dtype=i32, device=dev)  # MTP position of the draft step
        self.cand = torch.zeros(D, self.k, dtype=i32, device=dev)  # [D, k] top-k ids per depth
        self.temperature = torch.zeros(R, dtype=f32, device=dev)
        self.top_k = torch.zeros(R, dtype=i32, device=dev)
        self.top_p = torch.ones(R, dtype=f32, device=dev)
        self.seed = torch.zeros(R, dtype=i64, device=dev)
        self.min_p = torch.full((R,), -float("inf"), dtype=f32, device=dev)
        self.penalty = torch.zeros(R, 4, dtype=f32, device=dev)
        self.ban_until = torch.zeros(R, dtype=i64, device=dev)  # the runner's, for every row
        # A verify row's penalties see the committed history (the runner's) plus its path's drafted tokens;
        # its logit bias is the request's (the runner's).
        self.path = tb.path_nodes().to(dev)  # [R, D] node ids below the root
        pen = (runner.counts, runner.prompt_mask)
        ban = dict(stop_mask=runner.stop_mask, ban_until=self.ban_until)
        self.penalties = Penalties(self.penalty, *pen, self.path, self.tokens, runner.logit_bias, **ban)
        # The drafter's candidates under the same bias and penalties (its history: the spine drafted so far).
        self.draft_penalties = Penalties(self.penalty[0:1], *pen, bias=runner.logit_bias)

        # ---- target verify activations (R rows) + the replay operands of every GDN layer ----
        self.tr = _Rows(runner, R)
        self.tr.mask.copy_(tb.anc.to(dev))
        self.gdn_proj = torch.zeros(n_gdn, R, C + nv * dv, dtype=bf, device=dev)  # pre-conv [q|k|v] + z
        self.gdn_ba = torch.zeros(n_gdn, R, 2 * nv, dtype=bf, device=dev)  # [b | a]
        self.gdn_mixed = torch.zeros(n_gdn, R, C, dtype=bf, device=dev)  # post-conv rows (replay input)
        self.gdn_o = torch.zeros(R, nv, dv, dtype=bf, device=dev)
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.gdn_qk = torch.zeros(R, 2 * nk * dk, dtype=f32, device=dev)  # normalised q, k (any layer's)
        self.gdn_y = torch.zeros(R, nv * dv, dtype=bf, device=dev)
        self.replay_o = torch.zeros(self.cap, nv, dv, dtype=bf, device=dev)
        self.logits_bf16 = torch.zeros(R, V, dtype=bf, device=dev)  # [R, V] of the latest verify (`logits`)
        # A structured output's allowed tokens per row (the host's, between draft and verify: mask_tree)
        W = bitmask_words(V)
        self.token_masks = torch.zeros(R, W, dtype=i32, device=dev)  # [R, W] bitmasks
        self.token_masks_on = torch.zeros(R, dtype=i32, device=dev)  # [R] 0: the row is not masked
        pin = dev.type == "cuda"
        self._host_masks = torch.zeros(R, W, dtype=i32, pin_memory=pin)
        self._host_masks_on = torch.zeros(R, dtype=i32, pin_memory=pin)
        self._host_tokens = torch.zeros(R, dtype=i32, pin_memory=pin)  # the drafted tokens
        self._tokens_copied = torch.cuda.Event() if pin else None
        self.sample_ws = sample_workspace(R, V, dev)
        self.kv_tab = kv_table(runner.kv_k + runner.kv_v)

        # ---- MTP: its own K/V cache, a one-row draft step and a (D+1)-row feed ----
        nkv, d = cfg.num_key_value_heads, cfg.head_dim
        n_mtp = len(w.mtp.layers)
        self.mtp_k = [torch.zeros(runner.max_len, nkv, d, dtype=bf, device=dev) for _ in range(n_mtp)]
        self.mtp_v = [torch.zeros(runner.max_len, nkv, d, dtype=bf, device=dev) for _ in range(n_mtp)]
        self.d1 = _Rows(runner, 1)  # d1.out = the draft hidden (input of the next MTP step)
        self.feed = _Rows(runner, self.cap)
        self.feed.mask.copy_((1 << (torch.arange(self.cap, dtype=i64) + 1)) - 1)  # causal chain
        self.ar_cap = torch.arange(self.cap, dtype=i32, device=dev)
        self.mtp_emb = torch.zeros(self.cap, H, dtype=bf, device=dev)
        self.mtp_e = torch.zeros(self.cap, H, dtype=bf, device=dev)
        self.mtp_hn = torch.zeros(self.cap, H, dtype=bf, device=dev)
        self.mtp_cat = torch.zeros(self.cap, 2 * H, dtype=bf, device=dev)
        self.feed_tok = torch.zeros(self.cap, dtype=i32, device=dev)
        self.feed_hid = torch.zeros(self.cap, H, dtype=bf, device=dev)
        # The drafter's lm_head: a draft vocabulary's rows (GPUMTP.draft_head; the top-k maps its columns
        # to token ids through draft_ids) or the whole lm_head. The verify always uses the whole one.
        self.draft_head = w.mtp.draft_head or w.lm_head
        self.draft_ids = w.mtp.draft_ids  # [Vd] int32 ascending, or None
        Vd = self.draft_head.n
        if Vd < self.k:
            raise ValueError(f"a draft vocabulary of {Vd} tokens is smaller than the tree's top-{self.k}")
        self.draft_bf16 = torch.zeros(1, Vd, dtype=bf, device=dev)  # [1, Vd] next draft step's logits
        # A structured output's mask of a draft step (the whole vocabulary only: _draft_under), its flag
        # in the word after it, so that one copy from the pinned host row loads both.
        Wd = bitmask_words(Vd)
        self._draft_mask_row = torch.zeros(1, Wd + 1, dtype=i32, device=dev)
        self.draft_mask, self.draft_mask_on = self._draft_mask_row[:, :Wd], self._draft_mask_row[0, Wd:]
        self._host_draft_mask = torch.zeros(1, Wd + 1, dtype=i32, pin_memory=pin)
        self.tk_ws = topk_workspace(1, Vd, dev)
        self.graphs: dict[str, torch.cuda.CUDAGraph] | None = None
        # an event's pieces under a grammar, between which the host works (_grammar_pieces, _run_piece)
        self.grammar_graphs: dict[str, torch.cuda.CUDAGraph] | None = None
        self._pieces: dict[str, Callable[[], None]] | None = None
        self._carry: torch.Tensor | None = None
        self.root_only = torch.full((self.cap,), -1, dtype=i32, device=dev)  # `accepted` of a plain step
        self.root_only[0] = 0
        self._draft_stale = False  # plain steps left the draft head's logits to the next event

    @property
    def logits(self) -> torch.Tensor:
        """[R, V] f32 logits of the latest verify (a new tensor: the bf16 logits, then f32)."""
        return self.logits_bf16.float()

    def _gdn_schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """gdn_tree's schedule: each walking path's forks spread over as many rows (warps) as the device
        holds in one wave (gdn_tree_rows), which shortens the critical path; the same bits as the tree's
        one row per walking path (TreeBuffers.gdn_items)."""
        cfg, tb = self.cfg, self.tb
        layers = zip(cfg.layer_types, self.w.layers, strict=True)
        gdn = next((lw.mixer for kind, lw in layers if kind != FULL), None)
        if gdn is None:
            return tb.gdn_items, tb.gdn_items_len
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        max_rows = gdn_tree_rows(nk, nv, dk, dv, gdn.A_log.dtype == torch.bfloat16, True, self.dev)
        return gdn_schedule(tb.parent[: tb.n_nodes].tolist(), max_rows=max_rows)

    # ------------------------------------------------------------------------------------------
    # Host control.

    @torch.inference_mode()
    def set_sampling(self, params: SamplingParams) -> None:
        self.runner.set_sampling(params)
        self.temperature.fill_(params.temperature)
        self.top_k.fill_(params.top_k)
        self.top_p.fill_(params.top_p)
        self.seed.fill_(params.seed)
        self.min_p.copy_(self.runner.min_p.expand(self.R))
        self.penalty.copy_(self.runner.penalty.expand(self.R, 4))
        self.ban_until.copy_(self.runner.ban_until.expand(self.R))
        self.token_masks_on.zero_()

    def mask_tree(self, constraint: Constraint, tokens: list[int]) -> None:
        """After the draft: each verify row's allowed tokens, from the grammar state after its path
        (Constraint.tree_bitmasks; tokens: the tree's drafted tokens, on the host)."""
        n = self.tb.n_nodes
        on = constraint.tree_bitmasks(tokens, self.tb.parent[:n].tolist(), self._host_masks)
        self._host_masks_on[:n] = torch.tensor(on, dtype=torch.int32)  # padding rows stay 0
        # pinned sources, reused only after the event's result is read (a sync): no copy is in flight then
        self.token_masks[:n].copy_(self._host_masks[:n], non_blocking=True)
        self.token_masks_on.copy_(self._host_masks_on, non_blocking=True)

    def extra_bytes(self) -> int:
        """GPU memory tree decoding adds to plain decoding: MTP weights and cache, tree buffers."""
        seen: set[int] = set()
        total = self.w.mtp.nbytes()
        for obj in (self, self.tr, self.d1, self.feed):
            for x in obj.__dict__.values():
                for t in x if isinstance(x, list | tuple) else (x,):
                    if (
                        isinstance(t, torch.Tensor)
                        and t.device == self.dev
                        and t.untyped_storage().data_ptr() not in seen
                    ):
                        seen.add(t.untyped_storage().data_ptr())
                        total += t.untyped_storage().nbytes()
        return total

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int] | torch.Tensor, scored: PromptLogprobs | None = None) -> int:
        """Target prefill (the runner's, bitwise plain decoding's) with the MTP fed every prompt pair
        chunk by chunk, then the pair (h_{n-1}, pending) through the feed path (the first draft logits).
        Returns the first token (one host sync). scored: the prompt's logprobs are wanted (from position 0,
        no prefix reuse), collected there."""
        r = self.runner
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(self.dev)
        if ids.numel() + self.R > r.max_len:  # what the first event needs (event() checks each)
            raise ValueError(f"prompt of {ids.numel()} tokens leaves no room for a tree in {r.max_len}")
        # From a prefix snapshot (lumo.engine.prefix) the MTP's pairs resume with the hidden row of the
        # snapshot's last position, as the next chunk of an uncached prefill would.
        mtp = [*self.mtp_k, *self.mtp_v]  # parked with the target's K/V (prefix.py)
        start = r.resume(prompt_ids, owner=self._prefix_owner, reuse=scored is None, positions=mtp)
        self.cached_tokens = start
        self._carry = r.hidden.clone() if start else None

        def hook(hidden: torch.Tensor, start: int) -> None:
            if scored is not None:
                scored.hidden(hidden, start)
            self._mtp_prefill(ids, hidden, start)

        r.prefill(ids[start:], hidden_hook=hook)
        n = r.length
        self.tr.out[0:1].copy_(self._carry)  # the feed gathers from the verify's hidden rows
        self.accepted.fill_(-1)
        self.accepted[0] = 0
        self.result.fill_(-1)
        self.result[0] = 1
        self.result[2:3].copy_(r.tok)
        self.feed_start.fill_(n - 1)
        self._feed()
        self._draft_stale = False
        self.tokens[0:1].copy_(r.tok)
        self._carry = None
        return r.token()

    @torch.inference_mode()
    def event(self, use_graph: bool = False, constraint: Constraint | None = None) -> list[int]:
        """One speculative event; returns the emitted tokens (accepted drafts, then the new pending).
        constraint: a structured output's grammar state (masks the verify rows; the caller advances it)."""
        r = self.runner
        if r.length + self.R > r.max_len:
            raise ValueError(f"the cache is full ({r.max_len} positions incl. {self.R} tree slots)")
        if self._draft_stale:  # plain steps fed the MTP without its head (plain_step)
            self._draft_logits()
            self._draft_stale = False
        phases = {"draft": self._draft, "verify": self._verify, "commit": self._accept_commit}
        # The drafter proposes under the grammar along its spine (not with a draft vocabulary, whose columns
        # are not token ids): this changes what is proposed, never the output.
        spine = None if constraint is None or self.draft_ids is not None else constraint.spine()
        for name in EVENT_PHASES:
            if name == "draft" and spine is not None:
                self._draft_under(spine, use_graph)
                continue
            if name == "verify" and constraint is not None:
                self._verify_under(constraint, use_graph)
                continue
            if use_graph and self.graphs is not None:
                self.graphs[name].replay()
            else:
                phases[name]()
        res = self._read_result()
        n = res[0]
        r.length += n
        return res[2 : 2 + n]

    @torch.inference_mode()
    def plain_step(self, use_graph: bool = False) -> int:
        """One plain decoding step (the runner's own launches: the same bits as plain decoding, so the
        same token an event would emit there) that also feeds the MTP its pair, so that an event can
        follow at any time. The draft head waits for that event. Returns the new pending token."""
        r = self.runner
        if r.length >= r.max_len:
            raise ValueError(f"the cache is full ({r.max_len} positions)")
        if use_graph and self.graphs is not None:
            self.graphs["plain"].replay()
        else:
            self._plain()
        self._draft_stale = True
        r.length += 1
        return r.token()

    def _read_result(self) -> list[int]:
        # The one device-to-host copy of the event.
        if self.dev.type != "cuda":
            return self.result.tolist()
        if not hasattr(self, "_host"):
            self._host = torch.empty(self.result.shape, dtype=torch.int32, pin_memory=True)
            self._copied = torch.cuda.Event()
        self._host.copy_(self.result, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return self._host.tolist()

    def _state(self) -> list[torch.Tensor]:
        r = self.runner
        return [
            *r.gdn_state,
            *r.conv_state,
            r.tok,
            r.pos,
            r.sample_pos,
            r.counts,
            self.tokens,
            self.draft_bf16,
            self.d1.out,  # the first draft step's hidden input
        ]

    def can_capture(self) -> bool:
        """Room in the cache after the current length for capture()'s two warm-up events."""
        return self.runner.length + 3 * self.R + 3 * self.cap <= self.runner.max_len

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture draft, verify and accept+commit as three CUDA graphs, and a plain step as a fourth
        (`plain_step`, adaptive speculation). Two warm-up events (and plain steps) on a side
        stream compile and load every kernel; the state they advance is restored (what they wrote past
        len in the K/V caches and the MTP cache is rewritten before it is read)."""
        if not self.can_capture():
            raise ValueError("capture() needs room for two warm-up events in the cache")
        steps = {"draft": self._draft, "verify": self._verify, "commit": self._accept_commit}
        steps["plain"] = self._plain
        saved = [t.clone() for t in self._state()]
        side = torch.cuda.Stream(self.dev)
        side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                for fn in steps.values():
                    fn()
        torch.cuda.current_stream(self.dev).wait_stream(side)
        for t, s in zip(self._state(), saved, strict=True):
            t.copy_(s)
        self.graphs = _capture(steps)

    # ------------------------------------------------------------------------------------------
    # Shared pieces.

    def _gdn_operands(self, g: GPUGDN, i_gdn: int) -> tuple[torch.Tensor, ...]:
        """GDN layer i_gdn's verify rows and committed state as gdn_tree and the commit's gdn_decode replay
        take them: (mixed, b, a, A_log, dt_bias, state)."""
        ba, nv = self.gdn_ba[i_gdn], self.cfg.linear_num_value_heads
        return self.gdn_mixed[i_gdn], ba[:, nv:], ba[:, :nv], g.A_log, g.dt_bias, self.runner.gdn_state[i_gdn]

    def _mlp(self, lw: GPULayer, rows: _Rows) -> None:
        """rows.x -> rows.delta; the runner's arithmetic (silu rounded to bf16, then the product)."""
        swiglu(lw.gate_up, rows.x, act=rows.act, scratch=rows.mlp_scratch)
        lw.down(rows.act, out=rows.delta)

    def _attn(
        self, a: GPUAttn, rows: _Rows, length: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> None:
        """rows.x -> rows.delta: K/V to rows.slots at rows.positions, attention over [0, length) + the
        tree slots of rows.mask (runner._attn_decode for T rows)."""
        d = self.cfg.head_dim
        a.qkv(rows.x, out=rows.attn_proj)
        qk_norm_rope_kv(
            rows.qg,
            rows.k,
            rows.v,
            a.q_norm,
            a.k_norm,
            rows.positions,
            rows.slots,
            kc,
            vc,
            self.w.inv_freq,
            self.cfg.rms_norm_eps,
            q_out=rows.q,
            rope_scale=self.w.rope_scale,
        )
        attn_decode(
            rows.q,
            kc,
            vc,
            length,
            rows.mask,
            gate=rows.qg[:, :, d:],
            out=rows.attn_out,
            workspace=rows.attn_ws,
        )
        a.o_proj(rows.attn_out.view(rows.T, -1), out=rows.delta)

    def _mtp_rows(self, rows: _Rows, tok: torch.Tensor, hid: torch.Tensor, length: torch.Tensor) -> None:
        """The MTP head over T decode rows: pairs (hid[t], tok[t]) at rows.positions -> rows.out (its final
        norm output). K/V go to rows.slots of the MTP cache; attention sees [0, length) + rows.mask."""
        m, eps, T = self.w.mtp, self.cfg.rms_norm_eps, rows.T
        emb, e, hn, cat = self.mtp_emb[:T], self.mtp_e[:T], self.mtp_hn[:T], self.mtp_cat[:T]
        torch.index_select(self.w.embed, 0, tok, out=emb)
        rmsnorm1p(emb, m.pre_fc_norm_embedding, eps, out=e)
        rmsnorm1p(hid, m.pre_fc_norm_hidden, eps, out=hn)
        torch.cat([e, hn], dim=1, out=cat)  # embedding half first (lumo.model.mtp_forward)
        m.fc(cat, out=rows.h)
        delta = None
        for i, lw in enumerate(m.layers):
            rmsnorm1p(rows.h, lw.input_layernorm, eps, delta=delta, out=rows.x)
            self._attn(lw.mixer, rows, length, self.mtp_k[i], self.mtp_v[i])
            rmsnorm1p(rows.h, lw.post_attention_layernorm, eps, delta=rows.delta, out=rows.x)
            self._mlp(lw, rows)
            delta = rows.delta
        rmsnorm1p(rows.h, m.norm, eps, delta=delta, out=rows.out)

    @property
    def draft_logits(self) -> torch.Tensor:
        """[1, Vd] f32 logits of the next draft step (a new tensor: the bf16 head output, then f32, as
        lumo.model; topk_select reads the bf16 buffer as these values)."""
        return self.draft_bf16.float()

    def _draft_logits(self) -> None:
        self.draft_head(self.d1.out, out=self.draft_bf16)

    def _feed(self) -> None:
        self._feed_rows()
        self._draft_logits()

    def _feed_rows(self) -> None:
        """MTP K/V for the accepted pairs (h of accepted node j, emitted token j) at positions
        feed_start + j, j < count, computed over all D + 1 rows (rows past count write K/V past the
        committed MTP length, rewritten before read); the last pair's output -> the first draft step."""
        f = self.feed
        torch.clamp(self.accepted, min=0, out=self.feed_idx)
        torch.index_select(self.tr.out, 0, self.feed_idx, out=self.feed_hid)
        torch.clamp(self.result[2 : 2 + self.cap], min=0, out=self.feed_tok)
        torch.add(self.ar_cap, self.feed_start, out=f.positions)
        f.slots.copy_(f.positions)
        self._mtp_rows(f, self.feed_tok, self.feed_hid, self.feed_start)
        torch.sub(self.result[:1], 1, out=self.last_idx)
        torch.index_select(f.out, 0, self.last_idx, out=self.d1.out)

    def _plain(self) -> None:
        """The runner's decode step (tok at pos -> the next tok, pos += 1), then the feed of its one pair
        (the step's final-norm row, the new token) at MTP position pos - 1, as a one-node event's commit
        feeds it (accepted = root only, count 1). No allocation, no sync: captured as the "plain" graph."""
        r = self.runner
        self.feed_start.copy_(r.pos)
        r._step()
        self.tr.out[0:1].copy_(r.hidden)  # the feed gathers h from the verify's output rows
        self.accepted.copy_(self.root_only)
        self.result[0:1].fill_(1)
        self.result[2:3].copy_(r.tok)
        self._feed_rows()
        self.tokens[0:1].copy_(r.tok)

    # ------------------------------------------------------------------------------------------
    # The three phases of an event (launches only: no allocation, no sync).

    def _draft(self) -> None:
        """The MTP's spine and siblings: D one-row steps, each followed by its top-k selection."""
        self._draft_select(0)
        for dd in range(1, self.D):
            self._draft_step(dd)
            self._draft_select(dd)

    def _draft_select(self, dd: int, masked: bool = False) -> None:
        """topk_select of depth dd's spine token and siblings from the latest draft logits (dd = 0 starts
        the draft at MTP position len). masked: under the draft mask first (a grammar: _draft_under)."""
        if dd == 0:
            self.mtp_pos.copy_(self.runner.pos)
        if masked:
            apply_token_mask(self.draft_bf16, self.draft_mask, self.draft_mask_on)
        topk_select(
            self.draft_bf16,
            self.k,
            out=self.cand[dd : dd + 1],
            tokens=self.tokens,
            nodes=self.table[dd : dd + 1],
            workspace=self.tk_ws,
            id_map=self.draft_ids,
            penalties=self.draft_penalties,
            n_path=dd,  # spine tokens at depths 1..dd
        )

    def _draft_step(self, dd: int) -> None:
        """Draft step dd: the pair (draft hidden, spine token at depth dd) at MTP position len + dd - 1."""
        r1 = self.d1
        r1.positions.copy_(self.mtp_pos)
        r1.slots.copy_(self.mtp_pos)
        # r1.out (the previous step's output) is read by the first norm, rewritten by the last one.
        self._mtp_rows(r1, self.tokens[dd : dd + 1], r1.out, self.mtp_pos)
        self._draft_logits()
        self.mtp_pos.add_(1)

    def _grammar_pieces(self) -> dict[str, Callable[[], None]]:
        """An event's launch sequences under a grammar (each a graph once captured): the verify's forward
        and its sampling apart (_verify_under), and, with the whole vocabulary, the draft's pieces
        (_draft_under): select0, step1, select1, ..."""
        pieces = {"verify_forward": self._verify_forward, "verify_sample": self._verify_sample}
        if self.draft_ids is None:
            pieces["select0"] = functools.partial(self._draft_select, 0, masked=True)
            for dd in range(1, self.D):
                pieces[f"step{dd}"] = functools.partial(self._draft_step, dd)
                pieces[f"select{dd}"] = functools.partial(self._draft_select, dd, masked=True)
        return pieces

    def _run_piece(self, name: str, use_graph: bool) -> None:
        """One of _grammar_pieces: from its graph when the event's graphs are captured (the pieces' own
        are captured at their first use: requests without a grammar never pay for them), else eagerly."""
        if use_graph and self.graphs is not None:
            if self.grammar_graphs is None:
                self.grammar_graphs = _capture(self._grammar_pieces())  # the kernels are warm already
            self.grammar_graphs[name].replay()
        else:
            if self._pieces is None:
                self._pieces = self._grammar_pieces()
            self._pieces[name]()

    def _verify_under(self, constraint: Constraint, use_graph: bool) -> None:
        """The verify with each row masked by the grammar's state after its path: the host computes the
        rows' masks (mask_tree) while the GPU runs the target forward, then the masked rows are sampled."""
        n = self.tb.n_nodes
        cuda = self.dev.type == "cuda"
        if cuda:  # the drafted tokens to the host behind the draft, not behind the forward
            self._host_tokens[:n].copy_(self.tokens[:n], non_blocking=True)
            self._tokens_copied.record()
        self._run_piece("verify_forward", use_graph)
        if cuda:
            self._tokens_copied.synchronize()
        tokens = (self._host_tokens if cuda else self.tokens)[:n].tolist()
        self.mask_tree(constraint, tokens)
        self._run_piece("verify_sample", use_graph)

    def _draft_under(self, grammar: Constraint, use_graph: bool) -> None:
        """_draft with each depth's candidates under the grammar's state after the spine so far (grammar:
        the request's Constraint.spine() copy, walked here). Between the pieces the host reads the spine
        token (a sync per depth), advances the grammar while the GPU runs the next step, and loads that
        step's mask (one copy from a pinned row; its flag 0 while reasoning or once the grammar refused
        the spine, below which no verify row is reached anyway)."""
        state: Constraint | None = grammar
        self._load_draft_mask(state)
        self._run_piece("select0", use_graph)
        for dd in range(1, self.D):
            # a sync for the previous selection's spine token; none once refused (the flag stays 0)
            spine = None if state is None else int(self.tokens[dd])
            self._run_piece(f"step{dd}", use_graph)
            if state is not None:
                state = state if state.try_advance(spine) else None
                self._load_draft_mask(state)
            self._run_piece(f"select{dd}", use_graph)

    def _load_draft_mask(self, grammar: Constraint | None) -> None:
        """The next selection's mask and flag into the draft mask row (flag 0 where the grammar fails on the
        spine: a draft must not fail the request). The pinned row is rewritten only after the next sync
        (the spine's read, the event's result), which follows this copy."""
        host, W = self._host_draft_mask, self.draft_mask.shape[1]
        bits = None if grammar is None else grammar.draft_bitmask(out=host[0, :W])
        host[0, W] = int(bits is not None)
        self._draft_mask_row.copy_(host, non_blocking=True)

    def _verify(self) -> None:
        self._verify_forward()
        self._verify_sample()

    def _verify_forward(self) -> None:
        """The target forward over the R tree rows, through the lm_head."""
        cfg, w, v, eps = self.cfg, self.w, self.tr, self.cfg.rms_norm_eps
        r, L = self.runner, self.runner.pos
        C, nv, dv = cfg.conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
        heads = (cfg.linear_num_key_heads, nv, cfg.linear_key_head_dim, dv)
        torch.add(self.depth, L, out=v.positions)  # logical position len + depth
        torch.add(self.slot_off, L, out=v.slots)  # tree slot len + i (padding: negative, not written)
        self.len64.copy_(L)
        torch.add(self.depth1, self.len64, out=self.sample_pos)
        torch.index_select(w.embed, 0, self.tokens, out=v.h)
        delta = None
        i_full = i_gdn = 0
        for kind, lw in zip(cfg.layer_types, w.layers, strict=True):
            rmsnorm1p(v.h, lw.input_layernorm, eps, delta=delta, out=v.x)
            if kind == FULL:
                self._attn(lw.mixer, v, L, r.kv_k[i_full], r.kv_v[i_full])
                i_full += 1
            else:
                g: GPUGDN = lw.mixer
                proj, ba, mixed = self.gdn_proj[i_gdn], self.gdn_ba[i_gdn], self.gdn_mixed[i_gdn]
                with beside(r.side):  # a parallel branch beside q/k/v/z and the conv (GPURunner)
                    g.ba(v.x, out=ba)
                g.qkvz(v.x, out=proj)
                conv_gather_qk(
                    proj[:, :C], g.conv1d, r.conv_state[i_gdn], self.pred, heads, mixed, self.gdn_qk
                )
                join(r.side)
                gdn_tree(
                    *self._gdn_operands(g, i_gdn),
                    self.gdn_items,
                    self.gdn_items_len,
                    out=self.gdn_o,
                    qk=self.gdn_qk,
                )
                z = proj[:, C:].view(self.R, nv, dv)
                gated_rmsnorm(self.gdn_o, z, g.norm, eps, out=self.gdn_y)
                g.out_proj(self.gdn_y, out=v.delta)
                i_gdn += 1
            rmsnorm1p(v.h, lw.post_attention_layernorm, eps, delta=v.delta, out=v.x)
            self._mlp(lw, v)
            delta = v.delta
        rmsnorm1p(v.h, w.norm, eps, delta=delta, out=v.out)  # hidden states, kept for the MTP feed
        w.lm_head(v.out, out=self.logits_bf16)

    def _verify_sample(self) -> None:
        """Each row's choice: its logits under its grammar mask (if its flag is set), then sampled."""
        apply_token_mask(self.logits_bf16, self.token_masks, self.token_masks_on)
        sample_tokens(  # reads the bf16 logits as their f32 values (lumo.model's cast, no launch)
            self.logits_bf16,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seed,
            self.sample_pos,
            out=self.choice,
            workspace=self.sample_ws,
            min_p=self.min_p,
            penalties=self.penalties,
        )

    def _accept_commit(self) -> None:
        cfg, r = self.cfg, self.runner
        C = cfg.conv_dim
        tree_accept(
            self.tokens,
            self.choice,
            self.parent,
            self.tb.n_nodes,
            self.accepted,
            self.result,
            self.cap,
            count_out=r.counts,  # the emitted tokens join the penalties' history
        )
        count = self.result[:1]
        i_gdn = 0
        for kind, lw in zip(cfg.layer_types, self.w.layers, strict=True):
            if kind == FULL:
                continue
            gdn_decode(
                *self._gdn_operands(lw.mixer, i_gdn), out=self.replay_o, rows=self.accepted, count=count
            )
            conv_state_commit(r.conv_state[i_gdn], self.gdn_proj[i_gdn][:, :C], self.accepted)
            i_gdn += 1
        kv_remap(self.kv_tab, self.accepted, count, r.pos)  # before len advances
        self.feed_start.copy_(r.pos)
        self._feed()
        r.pos.add_(count)
        r.sample_pos.copy_(r.pos)
        r.sample_pos.add_(1)
        r.tok.copy_(self.result[1:2])
        self.tokens[0:1].copy_(self.result[1:2])

    # ------------------------------------------------------------------------------------------
    # MTP over the prompt (large-M paths, allocating: not part of the event).

    def _mtp_prefill(self, ids: torch.Tensor, hidden: torch.Tensor, start: int) -> None:
        """Pairs (h_q, x_{q+1}) of a prefill chunk; the chunk's last row waits for the next token."""
        rows = hidden[:-1] if self._carry is None else torch.cat([self._carry, hidden[:-1]])
        q0 = start if self._carry is None else start - 1
        self._carry = hidden[-1:].clone()
        T = rows.shape[0]
        if T == 0:
            return
        m, eps, d = self.w.mtp, self.cfg.rms_norm_eps, self.cfg.head_dim
        e = rmsnorm1p(self.w.embed.index_select(0, ids[q0 + 1 : q0 + 1 + T]), m.pre_fc_norm_embedding, eps)
        hn = rmsnorm1p(rows.contiguous(), m.pre_fc_norm_hidden, eps)
        h = m.fc(torch.cat([e, hn], dim=1))
        positions = torch.arange(q0, q0 + T, dtype=torch.int32, device=self.dev)
        delta = None
        for i, lw in enumerate(m.layers):
            a = lw.mixer
            x = rmsnorm1p(h, lw.input_layernorm, eps, delta=delta)
            qg, k, v = self.runner._attn_views(a.qkv(x), T)
            kc, vc = self.mtp_k[i], self.mtp_v[i]
            q = qk_norm_rope_kv(
                qg,
                k,
                v,
                a.q_norm,
                a.k_norm,
                positions,
                positions,
                kc,
                vc,
                self.w.inv_freq,
                eps,
                rope_scale=self.w.rope_scale,
            )
            o = attn_prefill(q, kc, vc, q0, gate=qg[:, :, d:])
            delta = a.o_proj(o.view(T, -1))
            if i + 1 == len(m.layers):
                break  # only the K/V of the prompt pairs are needed
            x = rmsnorm1p(h, lw.post_attention_layernorm, eps, delta=delta)
            delta = self.runner._mlp(lw, x)


class GPUSpecDecoder(ScoresTokens):
    """decode.SpecDecoder's interface (prefill / step / stats) on the GPU engine.

    backend_or_runner: a GPUBackend (the runner is grown to max_len + tree slots; pass max_len), a
    GPURunner, or a GPUSpecEngine (reused: no new buffers or graphs). The MTP head must be packed
    (pack_weights(..., mtp=True)). Eager by default; use_graph=True captures. adaptive: an AdaptiveSpec
    that takes plain steps instead of events while events do not pay (the same tokens either way).
    """

    constraint: Constraint | None = None  # a structured output's grammar state (set before prefill)

    def __init__(
        self,
        backend_or_runner: GPUBackend | GPURunner | GPUSpecEngine,
        params: SamplingParams,
        tree: TreeConfig | None = None,
        max_len: int | None = None,
        use_graph: bool = False,
        adaptive: AdaptiveSpec | None = None,
    ):
        tree = tree or TreeConfig()
        src = backend_or_runner
        if isinstance(src, GPUSpecEngine):
            self.engine = src
        else:
            if isinstance(src, GPUBackend):
                if max_len is None:
                    raise ValueError("GPUSpecDecoder over a GPUBackend needs max_len")
                src = src.runner_for(max_len, tree.rows + tree.depth + 1)
            self.engine = GPUSpecEngine(src, tree)
        self.params, self.use_graph, self.adaptive = params, use_graph, adaptive
        self.extra_positions = self.engine.R + self.engine.cap
        self.stats = SpecStats()
        self.pending: int | None = None
        self._init_scores()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the latest prefill took from the prefix cache."""
        return self.engine.cached_tokens

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        e = self.engine
        e.set_sampling(self.params)
        self.stats = SpecStats()
        if self.adaptive is not None:
            self.adaptive.new_request()
        scored = None
        if self.prompt_logprobs is not None:
            scored = PromptLogprobs(list(prompt_ids), self.prompt_logprobs, head=e.w.lm_head)
        self._mask_plain()
        self.pending = e.prefill(prompt_ids, scored)
        self.last_prompt_logprobs = [] if scored is None else scored.out
        self._note_logprobs(e.runner.logits_bf16, [self.pending])  # before capture()'s warm-up events
        self._advance([self.pending])
        if self.use_graph and e.graphs is None and e.can_capture():
            e.capture()  # after prefill: the warm-up runs on real state, then restores it
        return [self.pending]

    def _mask_plain(self) -> None:
        """The runner's next sample (a prefill's or a plain step's) masked by the grammar."""
        if self.constraint is not None:
            self.engine.runner.set_token_mask(self.constraint.bitmask())

    def _advance(self, tokens: list[int]) -> None:
        if self.constraint is not None:
            self.constraint.advance(tokens)

    def step(self) -> list[int]:
        # Graphs once captured; a first request whose prompt leaves no room for capture()'s warm-up
        # events runs eagerly (bitwise the same, tests/test_gpu_spec_gpu.py), and a later one captures.
        graph = self.use_graph and self.engine.graphs is not None
        a = self.adaptive
        if a is not None and not a.speculate():
            t0 = time.perf_counter()
            self._mask_plain()
            out = [self.engine.plain_step(use_graph=graph)]
            a.record_plain(time.perf_counter() - t0)
            self.stats.plain_steps += 1
            self._note_logprobs(self.engine.runner.logits_bf16, out)
        else:
            t0 = time.perf_counter()
            out = self.engine.event(use_graph=graph, constraint=self.constraint)
            if a is not None:
                a.record_event(len(out), time.perf_counter() - t0)
            self.stats.events += 1
            self.stats.accepted.append(len(out) - 1)
            if self.logprobs is not None:  # accepted node j's verify row chose emitted token j
                path = self.engine.accepted[: len(out)].long()
                self._note_logprobs(self.engine.logits_bf16.index_select(0, path), out)
        self.pending = out[-1]
        self._advance(out)
        return out


class SpecBackend:
    """What an LLM keeps for speculative decoding on the kernels: a GPUBackend (packed with the MTP head)
    and one engine (buffers + graphs) per runner, reused by every request."""

    def __init__(
        self,
        backend: GPUBackend,
        tree: TreeConfig | None = None,
        chain: bool = False,
        use_graph: bool = False,
        adaptive: bool = False,
    ):
        tree = tree or TreeConfig()
        self.backend, self.use_graph = backend, use_graph
        self.policy = AdaptiveSpec() if adaptive else None  # one for the backend's requests in turn
        self.tree = chain_config(tree.depth) if chain else tree
        self.engine: GPUSpecEngine | None = None

    @property
    def extra_positions(self) -> int:
        """Cache slots a runner holds beyond a request's positions: an event's tree rows after the
        committed ones (and the drafter's steps)."""
        return self.tree.rows + self.tree.depth + 1

    @property
    def attn_rows(self) -> int:
        """Rows of attention partials an engine keeps over its runner's positions (GPUSpecEngine's _Rows:
        the tree's rows, the draft step's one, the feed's depth + 1), for the start-up memory check."""
        return self.tree.rows + 1 + self.tree.depth + 1

    def decoder(self, params: SamplingParams, max_len: int, adaptive: bool = True) -> GPUSpecDecoder:
        """adaptive=False: events only, whatever the policy (its state untouched)."""
        policy = self.policy if adaptive else None
        return GPUSpecDecoder(self._engine_for(max_len), params, use_graph=self.use_graph, adaptive=policy)

    def reserve(self) -> GPUSpecEngine:
        """The engine on a runner sized for the whole context and the tree's slots, allocated now
        (GPUBackend.reserve: no request grows it, the prefix cache outlives every request)."""
        return self._engine_for(self.backend.max_model_len)

    def _engine_for(self, max_len: int) -> GPUSpecEngine:
        """The engine, on a runner that holds max_len positions and the tree's slots."""
        if self.engine is not None and self.engine.runner.max_len < max_len + self.extra_positions:
            self.engine = None  # its runner, caches and graphs freed before the larger runner is allocated
        runner = self.backend.runner_for(max_len, self.extra_positions)
        if self.engine is None or self.engine.runner is not runner:
            self.engine = None
            self.engine = GPUSpecEngine(runner, self.tree)
        return self.engine
