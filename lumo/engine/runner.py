"""GPURunner: the model on the GPU for one sequence slot, with its caches, chunked prefill and a decode step
that replays as one CUDA graph.

Every per-step value lives in a device buffer (the input token, its position, the sampling parameters and
the sampling position), and the step itself advances them, so replaying the graph N times decodes N tokens
with nothing but one 4-byte device-to-host read per token. The eager step (`use_graph=False`, or before
`capture()`) launches exactly the same kernels, so graph replay equals eager bitwise.

Device state after `prefill(ids)` of n tokens (and after every step, with n = length):
  caches hold positions [0, n); tok = the sampled, not yet forwarded token (position n);
  pos = n (tok's position = its KV slot = attn_decode's committed length); sample_pos = n + 1.
`decode_step()` forwards tok, writes its K/V at slot n, updates the GDN / conv states, samples the next
token at absolute position n + 1 (exactly decode.PlainDecoder's positions) into tok, then pos += 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from ..config import DEFAULT_PREFIX_LINES, DEFAULT_PREFIX_SNAPSHOTS, FULL, ModelConfig
from ..kernels.attention import CHUNK as ATTN_CHUNK
from ..kernels.attention import attn_decode, attn_decode_workspace, attn_prefill, check_heads
from ..kernels.conv import conv_prefill
from ..kernels.gdn import (
    CHUNKED_MIN_TOKENS,
    chunked_fits,
    chunked_workspace_bytes,
    fused_norm_ok,
    gdn_decode,
    gdn_decode_norm,
    gdn_prefill,
)
from ..kernels.norms import gated_rmsnorm, rmsnorm1p
from ..kernels.rope_kv import qk_norm_rope_kv
from ..kernels.sampling import Penalties, sample_tokens, sample_workspace
from ..kernels.token_mask import apply_token_mask
from ..weights import ModelWeights
from .gpu_weights import GPUGDN, GPUAttn, GPULayer, GPUWeights, pack_weights, swiglu, swiglu_scratch
from .grammar import bitmask_words
from .prefix import PrefixCache
from .sampling import SamplingParams, bias_vector

PREFILL_CHUNK = 2048  # tokens per prefill chunk: bounds the activations (docs/runner.md has the numbers)


@contextlib.contextmanager
def beside(side: torch.cuda.Stream | None) -> Iterator[None]:
    """Launch the block's kernels on `side`, after everything queued so far on the current stream (a fork;
    captured, a parallel branch of the graph). `join(side)` makes the current stream wait for them. None
    (a runner on the CPU, the kernel dry runs): in order on the current stream."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def join(side: torch.cuda.Stream | None) -> None:
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


class GPURunner:
    """One sequence on the GPU: packed weights, caches of capacity max_len, static decode buffers."""

    # The decode step's GDN recurrence and output norm in one launch (gdn_decode_norm; the same bits as
    # gdn_decode + gated_rmsnorm, which run where it is False or the head shape has no fused kernel).
    fuse_gdn_norm = True
    # The decode step's GDN out-projection copies its weights into shared memory while the recurrence before
    # it runs (nvfp4_linear's `stage`; the same bits). The attention out-projection's copy measured mixed on
    # the H200 (docs/kernels.md, session 24): off unless stage_attn_out_proj.
    stage_gdn_out_proj = True
    stage_attn_out_proj = False
    # Measurement only (bench/ab.py): the plain decode step skips the 128 norms between its blocks, so its
    # output is wrong (x stays as it was). The step time then bounds what a norm with no kernel of its own
    # could save (docs/runner.md, "A norm with no kernel and no handshake"). Never set by the library.
    timing_without_block_norms = False

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights | GPUWeights,
        max_len: int,
        prefill_chunk: int = PREFILL_CHUNK,
        device: torch.device | str = "cuda",
    ):
        if max_len < 1 or prefill_chunk < 1:
            raise ValueError("max_len and prefill_chunk must be positive")
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.cfg, self.max_len, self.prefill_chunk = cfg, max_len, prefill_chunk
        self.device = dev = torch.device(device)
        self.w = weights if isinstance(weights, GPUWeights) else pack_weights(cfg, weights, dev)
        bf, i32, i64, f32 = torch.bfloat16, torch.int32, torch.int64, torch.float32
        H, V, I = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size  # noqa: E741
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        C, K = cfg.conv_dim, cfg.linear_conv_kernel_dim
        n_full = len(cfg.full_attention_layers)
        n_gdn = cfg.num_layers - n_full

        # ---- caches of the sequence slot ----
        self.kv_k = [torch.zeros(max_len, nkv, d, dtype=bf, device=dev) for _ in range(n_full)]
        self.kv_v = [torch.zeros(max_len, nkv, d, dtype=bf, device=dev) for _ in range(n_full)]
        self.gdn_state = [torch.zeros(nv, dk, dv, dtype=f32, device=dev) for _ in range(n_gdn)]
        self.conv_state = [torch.zeros(C, K - 1, dtype=bf, device=dev) for _ in range(n_gdn)]
        self.length = 0  # host mirror of pos: committed tokens (checked against max_len without a sync)
        # Prompt prefixes kept across requests (lumo.engine.prefix); None: every prefill starts at 0.
        self.prefix: PrefixCache | None = None
        self._resumed = False  # resume() armed the next prefill to record its grid snapshots
        # Positions past `length` a request's decoding writes (a speculative engine's tree slots): what the
        # prefix cache checks a parked prefix against
        self.write_ahead = 0
        self._written = 0  # positions [0, _written) may have been written since the latest resume

        # ---- per-step values (device): what the captured graph reads and advances ----
        self.tok = torch.zeros(1, dtype=i32, device=dev)  # [1] input token of the next step
        self.pos = torch.zeros(1, dtype=i32, device=dev)  # [1] its position = KV slot = attention length
        self.sample_pos = torch.ones(1, dtype=i64, device=dev)  # [1] absolute position being sampled
        self.temperature = torch.zeros(1, dtype=f32, device=dev)  # [1] <= 0: greedy
        self.top_k = torch.zeros(1, dtype=i32, device=dev)  # [1] 0: off
        self.top_p = torch.ones(1, dtype=f32, device=dev)  # [1] 1: off
        self.seed = torch.zeros(1, dtype=i64, device=dev)  # [1]
        self.min_p = torch.full((1,), -float("inf"), dtype=f32, device=dev)  # [1] log(min_p), -inf: off
        # [1, 4] repetition, frequency, presence penalties, logit bias on (Penalties.row)
        self.penalty = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=f32, device=dev)
        self.logit_bias = torch.zeros(V, dtype=f32, device=dev)  # [V] the request's (set_sampling)
        # min_tokens: the stop tokens banned while sampling positions below ban_until (set_sampling)
        self.stop_mask = torch.zeros(V, dtype=torch.uint8, device=dev)
        self.ban_until = torch.zeros(1, dtype=i64, device=dev)
        # The request's token history (the sampling penalties'; begin_history): every sample the step
        # emits is added to counts by the sampler itself, an event's tokens by tree_accept.
        self.counts = torch.zeros(V, dtype=i32, device=dev)  # [V] generated tokens
        self.prompt_mask = torch.zeros(V, dtype=torch.uint8, device=dev)  # [V] 1: in the prompt
        self.penalties = Penalties(
            self.penalty, self.counts, self.prompt_mask, bias=self.logit_bias, stop_mask=self.stop_mask,
            ban_until=self.ban_until,
        )  # fmt: skip
        self.mask = torch.ones(1, dtype=i64, device=dev)  # [1] the row sees tree slot len + 0 (itself)
        # A structured output's allowed tokens for the next sample (set_token_mask; lumo.engine.grammar)
        self.token_mask = torch.zeros(1, bitmask_words(V), dtype=i32, device=dev)  # [1, W] bitmask
        self.token_mask_on = torch.zeros(1, dtype=i32, device=dev)  # [1] 0: no mask

        # ---- static activations of one decode row ----
        self.h = torch.zeros(1, H, dtype=bf, device=dev)  # residual stream
        self.x = torch.zeros(1, H, dtype=bf, device=dev)  # normed input of a block
        self.delta = torch.zeros(1, H, dtype=bf, device=dev)  # block output, added by the next norm
        self.hidden = torch.zeros(1, H, dtype=bf, device=dev)  # final-norm output
        self.gdn_proj = torch.zeros(1, C + nv * dv, dtype=bf, device=dev)  # [q | k | v | z]
        self.gdn_ba = torch.zeros(1, 2 * nv, dtype=bf, device=dev)  # [b | a]
        self.conv_out = torch.zeros(1, C, dtype=bf, device=dev)
        self.gdn_o = torch.zeros(1, nv, dv, dtype=bf, device=dev)
        self.gdn_y = torch.zeros(1, nv * dv, dtype=bf, device=dev)
        self.attn_proj = torch.zeros(1, nh * 2 * d + 2 * nkv * d, dtype=bf, device=dev)
        self.q = torch.zeros(1, nh, d, dtype=bf, device=dev)
        self.attn_out = torch.zeros(1, nh, d, dtype=bf, device=dev)
        self.mlp_scratch = swiglu_scratch(self.w.layers, 1, dev)  # the gate+up GEMV's rows, if not fused
        self.act = torch.zeros(1, I, dtype=bf, device=dev)
        self.logits_bf16 = torch.zeros(1, V, dtype=bf, device=dev)  # [1, V] of the latest step (`logits`)
        self.attn_ws = attn_decode_workspace(1, nh, d, max_len, dev)
        self.sample_ws = sample_workspace(1, V, dev)
        # Views into the static buffers, made once (the step only launches).
        self._qg, self._k, self._v = self._attn_views(self.attn_proj, 1)
        self._z = self.gdn_proj[:, C:].view(1, nv, dv)  # q/k/v (pre-conv) are the first C columns
        self._b, self._a = self.gdn_ba[:, :nv], self.gdn_ba[:, nv:]
        self._gdn_norm_fits = fused_norm_ok(dk, dv)  # the head shape has a fused recurrence + norm kernel
        # The GDN b/a projection (5120 -> 96 on the 27B: a few CTAs, latency-bound) runs on a side
        # stream beside the q/k/v/z GEMV (whose epilogue runs the conv), joined before the GDN kernel,
        # which sums its split-K slices itself (no reduce launch): in the captured graph a parallel branch,
        # off the step's critical path. The same bits as the kernels one after another.
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.graph: torch.cuda.CUDAGraph | None = None

    # ------------------------------------------------------------------------------------------
    # Host-side control (setup, not per step).

    @torch.inference_mode()
    def reset(self) -> None:
        """Empty the slot: zero GDN and conv states, length 0. K/V need no clearing (read only below len)."""
        for s in self.gdn_state + self.conv_state:
            s.zero_()
        # What the request before may have written: its length and its tree slots (prefill marks each
        # chunk's end before it runs: a failed chunk's positions too)
        self._written = max(self._written, min(self.max_len, self.length + max(self.write_ahead, 1)))
        self.length = 0
        self.pos.zero_()
        self.sample_pos.fill_(1)

    @torch.inference_mode()
    def set_sampling(self, params: SamplingParams) -> None:
        self.temperature.fill_(params.temperature)
        self.top_k.fill_(params.top_k)
        self.top_p.fill_(params.top_p)
        self.seed.fill_(params.seed)
        self.min_p.fill_(params.min_p_threshold)
        self.penalty.copy_(torch.tensor([Penalties.row(params)], dtype=torch.float32))
        if params.logit_bias:
            self.logit_bias.copy_(bias_vector(params.logit_bias, self.logit_bias.numel()))
        self.ban_until.fill_(params.ban_until if params.stop_ids else 0)
        if params.stop_ids:
            self.stop_mask.zero_()
            self.stop_mask[torch.tensor(params.stop_ids, device=self.device)] = 1
        self.token_mask_on.zero_()

    @torch.inference_mode()
    def set_token_mask(self, bits: torch.Tensor | None) -> None:
        """The next sample's allowed tokens: bits [W] int32 (lumo.engine.grammar.Constraint.bitmask), or
        None for all tokens (stream-ordered: the step launched next reads them)."""
        if bits is None:
            self.token_mask_on.zero_()
        else:
            self.token_mask[0].copy_(bits)
            self.token_mask_on.fill_(1)

    @torch.inference_mode()
    def begin_history(self, prompt_ids: Sequence[int]) -> None:
        """A new request's token history: its whole prompt (a resumed prefill's cached part too), nothing
        generated; resume() starts it, before the prefill whose sample is the first generated token."""
        self.counts.zero_()
        self.prompt_mask.zero_()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(self.device)
        self.prompt_mask.index_fill_(0, ids, 1)

    def enable_prefix_cache(self, snapshots: int, park: int = 0, lines: int = DEFAULT_PREFIX_LINES) -> None:
        """Keep up to `snapshots` prefix snapshots on this runner's prefill grid (0: none), and park up to
        `lines` prefixes other prompts would overwrite, each with up to `park` of its positions copied
        aside (prefix.py)."""
        self.prefix = PrefixCache(self.prefill_chunk, snapshots, park, lines=lines) if snapshots else None

    def prefix_state(self) -> list[torch.Tensor]:
        """What a prefix snapshot keeps: the recurrent states and the final-norm row of the last position
        (the MTP head's input for the next chunk's first pair)."""
        return [*self.gdn_state, *self.conv_state, self.hidden]

    @torch.inference_mode()
    def resume(
        self,
        ids: Sequence[int] | torch.Tensor,
        owner: object | None = None,
        reuse: bool = True,
        positions: Sequence[torch.Tensor] = (),
    ) -> int:
        """Prepare a prefill of the prompt `ids`: empty the slot, or, with a prefix cache, restore the
        state after the longest cached prefix of ids. Returns the position to prefill from: the caller
        prefills ids[start:] next (that prefill records the prompt's grid snapshots). owner: a token of
        whatever keeps caches beside the slot's (a GPUSpecEngine: its MTP K/V); prefixes cached by another
        owner's prefills are dropped. reuse=False: from position 0 (PrefixCache.resume). positions: the
        owner's position caches (the drafter's K/V), parked with the slot's K/V. The request's token
        history starts here too (begin_history: the whole prompt, nothing generated)."""
        self.reset()  # (a decoder's construction may have reset the slot before: `_written` keeps the mark)
        written, self._written = self._written, 0
        self.begin_history(ids)
        if self.prefix is None:
            return 0
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        slot = [*self.kv_k, *self.kv_v, *positions]
        self.length = self.prefix.resume(ids, self.prefix_state(), owner, reuse, slot, written)
        self._resumed = True
        return self.length

    def _forget_from(self, length: int) -> None:
        """K/V positions length.. are about to be written by something other than a resumed prefill."""
        if self.prefix is not None:
            self.prefix.truncate(length)

    @torch.inference_mode()
    def seek(self, length: int, token: int = 0) -> None:
        """Point the next decode step at position `length` with input `token`, keeping whatever the caches
        hold (benchmarks time steps at a given context this way; tests feed chosen tokens)."""
        if not 0 <= length < self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len})")
        self._forget_from(length)
        self.length = length
        self.pos.fill_(length)
        self.sample_pos.fill_(length + 1)
        self.tok.fill_(token)

    def token(self) -> int:
        """The latest sampled token (the one host sync per step)."""
        return int(self.tok.item())

    # ------------------------------------------------------------------------------------------
    # Prefill.

    @torch.inference_mode()
    def prefill(
        self,
        ids: Sequence[int] | torch.Tensor,
        chunk: int | None = None,
        hidden_hook: Callable[[torch.Tensor, int], None] | None = None,
    ) -> torch.Tensor:
        """Append the prompt at positions length.., in chunks of `chunk` tokens (default prefill_chunk), then
        sample the first token at position length (into tok). Returns the last row's logits [V] f32.
        hidden_hook(hidden [T, H] bf16, start), if given, receives every chunk's final-norm rows (the MTP
        head's input; speculative decoding) right after the chunk, before the next one overwrites them."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().to(self.device)
        n, chunk = ids.numel(), chunk or self.prefill_chunk
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if self.length + n > self.max_len:
            raise ValueError(f"prompt of {n} tokens after {self.length} exceeds max_len {self.max_len}")
        # After resume(): snapshots on the grid (the chunks must be the grid's); otherwise positions
        # length.. of a cached prefix are overwritten here.
        record = self._resumed and chunk == self.prefill_chunk and self.length % chunk == 0
        self._resumed = False
        if not record:
            self._forget_from(self.length)
        for s in range(0, n, chunk):
            self._written = max(self._written, self.length + min(chunk, n - s))
            self._prefill_chunk(ids[s : s + chunk], self.length, hidden_hook)
            self.length += min(chunk, n - s)
            if record and self.prefix.wants(self.length):
                self.prefix.add(self.length, self.prefix_state())
        self._logits()  # of the last chunk's last row (self.hidden): one lm_head per prompt, not per chunk
        self.pos.fill_(self.length)
        self.sample_pos.fill_(self.length)
        self._sample()
        self.sample_pos.fill_(self.length + 1)
        return self.logits[0]

    def _prefill_chunk(
        self, ids: torch.Tensor, start: int, hidden_hook: Callable[[torch.Tensor, int], None] | None = None
    ) -> None:
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        T = ids.numel()
        h = w.embed.index_select(0, ids)  # [T, H] bf16 residual stream
        x = torch.empty_like(h)
        positions = torch.arange(start, start + T, dtype=torch.int32, device=self.device)  # [T]
        delta = None
        i_full = i_gdn = 0
        for kind, lw in zip(cfg.layer_types, w.layers, strict=True):
            rmsnorm1p(h, lw.input_layernorm, eps, delta=delta, out=x)
            if kind == FULL:
                delta = self._attn_prefill(lw.mixer, x, positions, start, i_full)
                i_full += 1
            else:
                delta = self._gdn_prefill(lw.mixer, x, i_gdn)
                i_gdn += 1
            rmsnorm1p(h, lw.post_attention_layernorm, eps, delta=delta, out=x)
            delta = self._mlp(lw, x)
        # Only the last row's logits are needed (the first token). The norm is per row, so normalising all
        # rows for the hook gives the last row the same bits as normalising it alone.
        if hidden_hook is None:
            rmsnorm1p(h[-1:], w.norm, eps, delta=delta[-1:], out=self.hidden)
        else:
            hidden = rmsnorm1p(h, w.norm, eps, delta=delta)  # [T, H]
            self.hidden.copy_(hidden[-1:])
            hidden_hook(hidden, start)

    def _attn_prefill(
        self, a: GPUAttn, x: torch.Tensor, positions: torch.Tensor, start: int, i: int
    ) -> torch.Tensor:
        T, d = x.shape[0], self.cfg.head_dim
        qg, k, v = self._attn_views(a.qkv(x), T)
        q = qk_norm_rope_kv(
            qg,
            k,
            v,
            a.q_norm,
            a.k_norm,
            positions,
            positions,
            self.kv_k[i],
            self.kv_v[i],
            self.w.inv_freq,
            self.cfg.rms_norm_eps,
            rope_scale=self.w.rope_scale,
        )
        o = attn_prefill(q, self.kv_k[i], self.kv_v[i], start, gate=qg[:, :, d:])  # [T, nh, d]
        return a.o_proj(o.view(T, -1))

    def _gdn_prefill(self, g: GPUGDN, x: torch.Tensor, i: int) -> torch.Tensor:
        cfg = self.cfg
        T, C, nv, dv = x.shape[0], cfg.conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
        proj, ba = g.qkvz(x), g.ba(x)  # [T, C + nv*dv], [T, 2nv]
        mixed = conv_prefill(proj[:, :C], g.conv1d, self.conv_state[i])  # [T, C], state updated
        o = gdn_prefill(mixed, ba[:, nv:], ba[:, :nv], g.A_log, g.dt_bias, self.gdn_state[i])  # [T, nv, dv]
        y = gated_rmsnorm(o, proj[:, C:].view(T, nv, dv), g.norm, cfg.rms_norm_eps)  # [T, nv*dv]
        return g.out_proj(y)

    def _mlp(self, lw: GPULayer, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:  # prefill rows
            return lw.down(swiglu(lw.gate_up, x))
        swiglu(lw.gate_up, x, act=self.act, scratch=self.mlp_scratch)  # the decode row: static buffers
        return lw.down(self.act, out=out)

    def _attn_views(self, proj: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nh, nkv, d = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        qg, k, v = proj.split([nh * 2 * d, nkv * d, nkv * d], dim=-1)
        return qg.view(T, nh, 2 * d), k.view(T, nkv, d), v.view(T, nkv, d)

    @property
    def logits(self) -> torch.Tensor:
        """[1, V] f32 logits of the latest step (a new tensor: lumo.model's bf16 logits, then f32). The
        sampler reads the bf16 buffer itself, as these values."""
        return self.logits_bf16.float()

    def _logits(self) -> None:
        self.w.lm_head(self.hidden, out=self.logits_bf16)

    def _sample(self) -> None:
        apply_token_mask(self.logits_bf16, self.token_mask, self.token_mask_on)
        sample_tokens(
            self.logits_bf16,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seed,
            self.sample_pos,
            out=self.tok,
            workspace=self.sample_ws,
            min_p=self.min_p,
            penalties=self.penalties,
            count_out=self.counts,
        )

    # ------------------------------------------------------------------------------------------
    # Decode: one token through every layer, launches only (no allocation, no sync).

    def _step(self) -> None:
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        torch.index_select(w.embed, 0, self.tok, out=self.h)
        delta = None
        i_full = i_gdn = 0
        norms = not self.timing_without_block_norms
        for kind, lw in zip(cfg.layer_types, w.layers, strict=True):
            if norms:
                rmsnorm1p(self.h, lw.input_layernorm, eps, delta=delta, out=self.x)
            if kind == FULL:
                self._attn_decode(lw.mixer, i_full)
                i_full += 1
            else:
                self._gdn_decode(lw.mixer, i_gdn)
                i_gdn += 1
            if norms:
                rmsnorm1p(self.h, lw.post_attention_layernorm, eps, delta=self.delta, out=self.x)
            self._mlp(lw, self.x, out=self.delta)
            delta = self.delta
        rmsnorm1p(self.h, w.norm, eps, delta=delta, out=self.hidden)
        self._logits()
        self._sample()
        self.pos.add_(1)
        self.sample_pos.add_(1)

    def _attn_decode(self, a: GPUAttn, i: int) -> None:
        d = self.cfg.head_dim
        a.qkv(self.x, out=self.attn_proj)
        kc, vc = self.kv_k[i], self.kv_v[i]
        qk_norm_rope_kv(
            self._qg,
            self._k,
            self._v,
            a.q_norm,
            a.k_norm,
            self.pos,
            self.pos,
            kc,
            vc,
            self.w.inv_freq,
            self.cfg.rms_norm_eps,
            q_out=self.q,
            rope_scale=self.w.rope_scale,
        )
        attn_decode(
            self.q,
            kc,
            vc,
            self.pos,
            self.mask,
            gate=self._qg[:, :, d:],
            out=self.attn_out,
            workspace=self.attn_ws,
        )
        a.o_proj(self.attn_out.view(1, -1), out=self.delta, stage=self.stage_attn_out_proj)

    def _gdn_decode(self, g: GPUGDN, i: int) -> None:
        cs, ss = self.conv_state[i], self.gdn_state[i]
        with beside(self.side):  # joined before gdn_decode
            # A split-K b/a projection leaves its slices' sum to gdn_decode (one launch fewer; same bits).
            part = g.ba.splitk_partials(self.x)
            if part is None:
                g.ba(self.x, out=self.gdn_ba)
        # q/k/v/z, then the conv over the state's window and x appended, in the GEMV's epilogue where it can
        g.qkvz(self.x, out=self.gdn_proj, conv=(g.conv1d, cs, self.conv_out))
        join(self.side)
        nv, eps = self._a.shape[1], self.cfg.rms_norm_eps
        ba_splitk = None if part is None else (part[:, 0, nv:], part[:, 0, :nv])  # [b | a] columns
        if self.fuse_gdn_norm and self._gdn_norm_fits:
            gdn_decode_norm(
                self.conv_out, self._a, self._b, g.A_log, g.dt_bias, ss, self._z, g.norm, eps,
                out=self.gdn_y, ba_splitk=ba_splitk,
            )  # fmt: skip
        else:
            gdn_decode(
                self.conv_out, self._a, self._b, g.A_log, g.dt_bias, ss, out=self.gdn_o, ba_splitk=ba_splitk
            )
            gated_rmsnorm(self.gdn_o, self._z, g.norm, eps, out=self.gdn_y)
        g.out_proj(self.gdn_y, out=self.delta, stage=self.stage_gdn_out_proj)

    @torch.inference_mode()
    def decode_step(self, use_graph: bool = True) -> None:
        """Forward tok, sample the next one into tok. Replays the captured graph when there is one."""
        if self.length >= self.max_len:
            raise ValueError(f"the cache is full ({self.max_len} positions)")
        if use_graph and self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        self.length += 1

    def _state(self) -> list[torch.Tensor]:
        return [*self.gdn_state, *self.conv_state, self.tok, self.pos, self.sample_pos, self.counts]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture `_step` as a CUDA graph. The warm-up steps (side stream, as torch requires; they also
        compile the kernels) advance the state, so it is saved first and restored after; K/V written at
        slots >= length are never read before being rewritten."""
        if self.length + 2 > self.max_len:
            raise ValueError("capture() needs two free cache positions for its warm-up steps")
        self._forget_from(self.length)  # the warm-up writes K/V at length..
        saved = [t.clone() for t in self._state()]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(self._state(), saved, strict=True):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records only: the state is not advanced
            self._step()
        self.graph = graph


# ---------------------------------------------------------------------------------------------
# Memory plan (docs/runner.md): bytes by component for a config, a context and a prefill chunk.


def linear_shapes(cfg: ModelConfig, dense_ba: bool = True) -> list[tuple[int, int, bool]]:
    """(N, K, quantized) of every linear weight of the model incl. lm_head, fused as the runner packs
    them (q/k/v/z, gate+up, attention q+gate/k/v); the GDN b/a projection stays dense if dense_ba."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nv, dv, C = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim
    shapes = [(V, H, True)]
    for kind in cfg.layer_types:
        shapes += [(2 * I, H, True), (H, I, True)]
        if kind == FULL:
            shapes += [(nh * 2 * d + 2 * nkv * d, H, True), (H, nh * d, True)]
        else:
            shapes += [(C + nv * dv, H, True), (H, nv * dv, True), (2 * nv, H, not dense_ba)]
    return shapes


def linear_weight_bytes(cfg: ModelConfig, nvfp4: bool = True, dense_ba: bool = True) -> int:
    """Bytes of every linear weight incl. lm_head: NVFP4 = 0.5 B/weight + one 2-byte pair of scales per 32
    weights (the packed layout; rows padded to 64, K to 64) + 4 B/row; dense = 2 B/weight."""

    def size(n: int, k: int, quantized: bool) -> int:
        if not (nvfp4 and quantized):
            return 2 * n * k
        n_pad, k_pad = -(-n // 64) * 64, -(-k // 64) * 64
        return n_pad * k_pad // 2 + n_pad * k_pad // 16 + 4 * n_pad

    return sum(size(n, k, q) for n, k, q in linear_shapes(cfg, dense_ba))


def splitk_partial_bytes(cfg: ModelConfig, min_splits: int = 16) -> int:
    """Bytes of the NVFP4 weights' split-K partial buffers that a run can allocate ([S, 32, N] f32, made
    by the first launch that needs one, lumo.kernels.linear.nvfp4_linear): those of weights with S >=
    min_splits slices, which run the cross-CTA kernel at M > 16 where the device cannot schedule S-CTA
    clusters. 16 (default) for sm_90+: a GB10 may refuse 16-CTA clusters (the H200 schedules them, so
    nothing is allocated there); 8 below sm_90; 2 counts every split weight."""
    from ..kernels.linear import SMALL_M, choose_splits

    total = 0
    for n, k, quantized in linear_shapes(cfg):
        s = choose_splits(n, k) if quantized else 1
        total += 4 * s * SMALL_M * n if s > 1 and s >= min_splits else 0
    return total


def _parked_positions(max_len: int, prefix_snapshots: int, prefix_park: int, prefix_lines: int) -> int:
    """Positions the parked prefixes hold copied aside at most: prefix_park of them per line, and one
    line's more while a swap parks the slot's prefix before the swapped one's copy is freed (none without
    prefix caching)."""
    if not (prefix_snapshots and prefix_park and prefix_lines):
        return 0
    return (prefix_lines + 1) * min(prefix_park, max_len)


def cache_bytes(
    cfg: ModelConfig,
    max_len: int,
    chunk: int = PREFILL_CHUNK,
    prefix_snapshots: int = DEFAULT_PREFIX_SNAPSHOTS,
    mtp_layers: int = 0,
    prefix_park: int = 0,
    attn_rows: int = 0,
    prefix_lines: int = DEFAULT_PREFIX_LINES,
) -> int:
    """GPU memory a runner of max_len positions needs beside the packed weights: memory_plan's caches,
    buffers, prefill peak and prefix snapshots (the parked prefixes' too), the K/V of `mtp_layers` drafter
    layers (a speculative engine's own cache of max_len positions, and the parked prefixes' copies of it),
    and `attn_rows` rows of attention split-K partials over max_len positions (a speculative engine's tree,
    draft and feed rows: attn_decode_workspace)."""
    parking = {"prefix_snapshots": prefix_snapshots, "prefix_park": prefix_park, "prefix_lines": prefix_lines}
    plan = memory_plan(cfg, max_len, chunk, **parking)
    park = _parked_positions(max_len, **parking)
    mtp_kv = mtp_layers * (max_len + park) * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    partials = attn_rows * cfg.num_attention_heads * -(-max_len // ATTN_CHUNK) * (cfg.head_dim + 2) * 4
    return sum(v for k, v in plan.items() if k != "weights") + mtp_kv + partials


def memory_plan(
    cfg: ModelConfig,
    max_len: int,
    chunk: int = PREFILL_CHUNK,
    nvfp4: bool = True,
    partial_min_splits: int = 16,
    prefix_snapshots: int = DEFAULT_PREFIX_SNAPSHOTS,
    prefix_park: int = 0,
    prefix_lines: int = DEFAULT_PREFIX_LINES,
) -> dict:
    """Bytes of each part of a runner: weights, caches, decode buffers, the per-chunk prefill peak and the
    prefix cache's snapshots and parked prefixes (prefix.py: up to prefix_lines of them, each with as many
    snapshots and at most prefix_park positions of K/V copied aside; one line's positions more while a swap
    parks the slot's prefix before it frees the swapped one's).
    partial_min_splits: see splitk_partial_bytes (16 for sm_90+, 8 below). Plain decoding: the MTP head of
    tree speculation is not counted (bench/bench_spec.py reports it)."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nv, dk, dv, C, K = (
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
        cfg.conv_dim,
        cfg.linear_conv_kernel_dim,
    )
    n_full = len(cfg.full_attention_layers)
    n_gdn = cfg.num_layers - n_full
    T = chunk
    # Prefill activations alive at once inside the widest block (MLP or GDN): h, x, delta, gate_up, act,
    # plus the GDN block's proj/conv/o/y and its chunked recurrence's fp32 workspace or the attention
    # block's proj/q/o (the larger), the NVFP4 dequantised tile (lumo.kernels.linear.PREFILL_WORKSPACE)
    # and the layer's output.
    mlp = 2 * T * (3 * H + 2 * I + I)
    gdn = 2 * T * (3 * H + (C + nv * dv) + 2 * nv + C + 2 * nv * dv)
    if T >= CHUNKED_MIN_TOKENS and chunked_fits(dk, dv):
        gdn += chunked_workspace_bytes(T, nv, dk, dv)
    attn = 2 * T * (3 * H + (nh * 2 * d + 2 * nkv * d) + 2 * nh * d)
    attn_partials = 4 * nh * (-(-max_len // ATTN_CHUNK)) * (d + 2)  # one row's attn_decode_workspace
    park = _parked_positions(max_len, prefix_snapshots, prefix_park, prefix_lines)
    park_snapshots = prefix_lines * prefix_snapshots if park else 0
    snapshot = n_gdn * (nv * dk * dv * 4 + C * (K - 1) * 2) + 2 * H  # GDN, conv states, final-norm row
    return {
        "weights": linear_weight_bytes(cfg, nvfp4) + 2 * V * H,  # linears + bf16 embedding
        "splitk_partials": splitk_partial_bytes(cfg, partial_min_splits) if nvfp4 else 0,
        "kv_cache": n_full * max_len * nkv * d * 2 * 2,  # K and V, bf16
        "gdn_state": n_gdn * nv * dk * dv * 4,
        "conv_state": n_gdn * C * (K - 1) * 2,
        "decode_buffers": attn_partials + 2 * V + 4 * 2 * (2 * I + C + nv * dv),  # + logits, activations
        "prefill_chunk": max(mlp, gdn, attn) + (64 << 20),
        "prefix_snapshots": prefix_snapshots * snapshot,
        "prefix_parked": park_snapshots * snapshot + n_full * park * nkv * d * 2 * 2,
    }
