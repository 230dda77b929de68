"""The hybrid model in plain torch: the reference every kernel and the speculative engine is tested against.

Functions over `ModelWeights` and a `Cache` (MODEL.md is the spec; transformers' `Qwen3_5ForCausalLM` the
check). Runs on CPU or GPU in float32 or bfloat16 and is differentiable. Norms, the gated delta rule,
RoPE and softmax are computed in fp32 internally (fp64 when the weights are fp64, which tests use to
measure rounding); activations between ops stay in the model dtype.
Without a cache, `forward` is vectorised over a batch [B, T] (training); with a cache it serves one
sequence (B = 1): prefill uses the chunked gated delta rule from the cached state, single-token decode
the plain recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .config import FULL, ModelConfig, RopeScaling
from .rope import rope_table
from .weights import AttnWeights, GDNWeights, LayerWeights, Linear, MLPWeights, ModelWeights

# ---------------------------------------------------------------------------------------------
# Runtime state of one sequence.


@dataclass
class Cache:
    """Preallocated state of one sequence (batch 1). Lists are in layer order within their kind."""

    kv_k: list[torch.Tensor]  # per full-attention layer [max_len, nkv, d], model dtype
    kv_v: list[torch.Tensor]  # per full-attention layer [max_len, nkv, d]
    gdn_state: list[torch.Tensor]  # per GDN layer [nv, dk, dv] f32
    conv_state: list[torch.Tensor]  # per GDN layer [C, K-1]: the last K-1 PRE-conv inputs
    mtp_k: list[torch.Tensor] = field(default_factory=list)  # per MTP layer [max_len, nkv, d]
    mtp_v: list[torch.Tensor] = field(default_factory=list)  # per MTP layer [max_len, nkv, d]
    length: int = 0  # committed tokens whose K/V and state are in the cache
    mtp_length: int = 0  # positions whose MTP K/V are in the cache

    @property
    def max_len(self) -> int:
        return self.kv_k[0].shape[0] if self.kv_k else self.mtp_k[0].shape[0] if self.mtp_k else 1 << 62

    def clone(self) -> Cache:
        """A deep copy (the speculative engine snapshots states with it)."""

        def cl(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [t.clone() for t in ts]

        return replace(
            self,
            kv_k=cl(self.kv_k),
            kv_v=cl(self.kv_v),
            gdn_state=cl(self.gdn_state),
            conv_state=cl(self.conv_state),
            mtp_k=cl(self.mtp_k),
            mtp_v=cl(self.mtp_v),
        )


@dataclass
class CacheSnapshot:
    """What a speculative step can change: the recurrent state, the lengths and K/V rows [lo, hi)."""

    gdn_state: list[torch.Tensor]
    conv_state: list[torch.Tensor]
    kv: list[torch.Tensor]  # target K and V rows [lo, hi) of every attention layer
    lo: int
    length: int


def snapshot(cache: Cache, lo: int, hi: int) -> CacheSnapshot:
    """A cheap copy for speculation: K/V outside [lo, hi) must not be written until `restore`."""
    return CacheSnapshot(
        gdn_state=[t.clone() for t in cache.gdn_state],
        conv_state=[t.clone() for t in cache.conv_state],
        kv=[t[lo:hi].clone() for t in cache.kv_k + cache.kv_v],
        lo=lo,
        length=cache.length,
    )


def restore(cache: Cache, snap: CacheSnapshot) -> None:
    for dst, src in zip(cache.gdn_state + cache.conv_state, snap.gdn_state + snap.conv_state, strict=True):
        dst.copy_(src)
    for dst, src in zip(cache.kv_k + cache.kv_v, snap.kv, strict=True):
        dst[snap.lo : snap.lo + src.shape[0]].copy_(src)
    cache.length = snap.length


def new_cache(
    cfg: ModelConfig, max_len: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Cache:
    nkv, d = cfg.num_key_value_heads, cfg.head_dim
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    C, K = cfg.conv_dim, cfg.linear_conv_kernel_dim
    n_full = len(cfg.full_attention_layers)
    n_gdn = cfg.num_layers - n_full

    def kv(n: int) -> list[torch.Tensor]:
        return [torch.zeros(max_len, nkv, d, device=device, dtype=dtype) for _ in range(n)]

    return Cache(
        kv_k=kv(n_full),
        kv_v=kv(n_full),
        gdn_state=[torch.zeros(nv, dk, dv, device=device, dtype=torch.float32) for _ in range(n_gdn)],
        conv_state=[torch.zeros(C, K - 1, device=device, dtype=dtype) for _ in range(n_gdn)],
        mtp_k=kv(cfg.mtp_num_hidden_layers),
        mtp_v=kv(cfg.mtp_num_hidden_layers),
    )


# ---------------------------------------------------------------------------------------------
# Small pure ops (the kernels are tested against these).


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Accumulation dtype: fp32, or fp64 when the model runs in fp64 (to measure fp32 rounding)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def linear(x: torch.Tensor, lin: Linear) -> torch.Tensor:
    """x @ W^T; quantised leaves are dequantised to x's dtype (fine for a reference)."""
    return x @ lin.dequantize(x.dtype).T


def rmsnorm1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(x / rms(x)) * (1 + w) in fp32, cast back after the multiply (layer, final, q/k and MTP norms)."""
    xf = _acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + _acc(w))).to(x.dtype)


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm over dv: w * rmsnorm(o) * silu(z), plain weight (not 1+w); result in z's dtype."""
    of = _acc(o)
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _acc(w) * F.silu(_acc(z))).to(z.dtype)


def apply_partial_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """RoPE (rotate_half pairs (j, j + rotary_dim/2)) on the first rotary_dim dims of each head.

    x [..., T, n, d]; positions [T] or [B, T] (broadcast against x's leading dims); scaling: the config's
    linear / yarn RoPE (lumo.rope), cos and sin multiplied by its attention factor.
    """
    if rotary_dim == 0:
        return x
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq, factor = rope_table(rotary_dim, theta, scaling, x.device, acc)
    freqs = positions.to(x.device, acc)[..., None] * inv_freq  # [..., T, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # [..., T, 1, rd]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    xr, xp = _acc(x[..., :rotary_dim]), x[..., rotary_dim:]
    half = rotary_dim // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([(xr * cos + rot * sin).to(x.dtype), xp], dim=-1)


def causal_conv(
    x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time followed by SiLU.

    x [..., T, C] pre-conv inputs; w [C, K]; state [..., C, K-1] the K-1 inputs before x (None = zeros).
    Returns y [..., T, C] (x's dtype) and the new state [..., C, K-1] (the last K-1 pre-conv inputs).
    """
    C, K = w.shape
    xt = x.transpose(-1, -2)  # [..., C, T]
    if state is None:
        state = xt.new_zeros(*xt.shape[:-1], K - 1)
    full = torch.cat([state.to(x.dtype), xt], dim=-1)  # [..., C, K-1+T]
    lead = full.shape[:-2]
    y = F.conv1d(full.reshape(-1, C, full.shape[-1]), w.to(x.dtype)[:, None, :], groups=C)  # [*, C, T]
    y = F.silu(y).reshape(*lead, C, -1).transpose(-1, -2)
    return y, full[..., full.shape[-1] - (K - 1) :]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [..., T, nk, dk] (after conv), a, b [..., T, nv] -> fp32 operands of the gated delta rule:
    (l2norm(q) / sqrt(dk), l2norm(k), g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b))."""
    dk = q.shape[-1]
    qn = l2norm(_acc(q)) * dk**-0.5
    kn = l2norm(_acc(k))
    g = -_acc(A_log).exp() * F.softplus(_acc(a) + _acc(dt_bias))  # [..., T, nv] log-decay <= 0
    beta = torch.sigmoid(_acc(b))
    return qn, kn, g, beta


def _heads_first(q, k, v, g, beta):
    """Expand key heads to value heads (head h reads key head h // r) and move heads before time."""
    r = v.shape[-2] // k.shape[-2]
    q, k = (_acc(t).repeat_interleave(r, dim=-2) if r > 1 else _acc(t) for t in (q, k))
    q, k, v = (t.transpose(-3, -2) for t in (q, k, _acc(v)))  # [..., nv, T, d]
    return q, k, v, _acc(g).transpose(-1, -2), _acc(beta).transpose(-1, -2)  # g, beta [..., nv, T]


def _initial_state(state, v, dk):
    if state is not None:
        return _acc(state)
    return _acc(v).new_zeros(*v.shape[:-3], v.shape[-2], dk, v.shape[-1])


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, token by token (MODEL.md step 6), fp32.

    q, k [..., T, nk, dk] (after gdn_prepare); v [..., T, nv, dv]; g, beta [..., T, nv];
    state [..., nv, dk, dv] or None (zeros). Returns o [..., T, nv, dv] f32 and the final state.
    """
    S = _initial_state(state, v, q.shape[-1])  # [..., nv, dk, dv] f32
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    outs = []
    for t in range(q.shape[-2]):
        S = S * g[..., t].exp()[..., None, None]
        kt = k[..., t, :]  # [..., nv, dk]
        u = torch.einsum("...kv,...k->...v", S, kt)  # [..., nv, dv]
        delta = beta[..., t, None] * (v[..., t, :] - u)
        S = S + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("...kv,...k->...v", S, q[..., t, :]))
    return torch.stack(outs, dim=-3), S  # o [..., T, nv, dv]


def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function as gdn_recurrent, in chunks of `chunk` tokens (WY / UT form), fp32.

    Inside a chunk with cumulative log-decay c_t and Γ_t = exp(c_t), the state after token t is
    Γ_t S0 + sum_{j<=t} exp(c_t - c_j) k_j u_j^T, where the corrected values u solve the unit lower-
    triangular system (I + A) u = beta*v - (beta*Γ*k) S0 with A_tj = beta_t (k_t.k_j) exp(c_t - c_j), j < t.
    Every exponent is <= 0. Loops over chunks only.
    """
    S = _initial_state(state, v, q.shape[-1])
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    T = q.shape[-2]
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc = (t[..., s : s + chunk, :] for t in (q, k, v))  # [..., nv, c, d]
        gc, bc = g[..., s : s + chunk], beta[..., s : s + chunk]  # [..., nv, c]
        c = qc.shape[-2]
        cum = gc.cumsum(-1)  # [..., nv, c]
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= t
        decay = torch.where(
            lower, cum[..., :, None] - cum[..., None, :], float("-inf")
        ).exp()  # [..., nv, c, c]
        kb = kc * bc[..., None]
        A = ((kb @ kc.mT) * decay).tril(-1)
        eye = torch.eye(c, dtype=A.dtype, device=A.device)
        rhs = torch.cat([vc * bc[..., None], kb * cum.exp()[..., None]], dim=-1)
        sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        u = sol[..., : vc.shape[-1]] - sol[..., vc.shape[-1] :] @ S  # [..., nv, c, dv]
        o = (qc * cum.exp()[..., None]) @ S + ((qc @ kc.mT) * decay) @ u
        S = S * cum[..., -1:, None].exp() + (kc * (cum[..., -1:] - cum).exp()[..., None]).mT @ u
        outs.append(o)
    return torch.cat(outs, dim=-2).transpose(-3, -2), S  # o [..., T, nv, dv]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Causal GQA softmax attention, fp32 inside, scale d**-0.5.

    q [B, T, nh, d]; k, v [B, S, nkv, d]. Query t sits at position offset + t and sees keys s <= offset + t.
    Query head h uses kv head h // (nh / nkv). Returns [B, T, nh, d] in q's dtype.
    """
    B, T, nh, d = q.shape
    S, nkv = k.shape[1], k.shape[2]
    qg = _acc(q).view(B, T, nkv, nh // nkv, d)
    scores = torch.einsum("btkgd,bskd->bkgts", qg, _acc(k)) * d**-0.5  # [B, nkv, g, T, S]
    pos_q = torch.arange(T, device=q.device)[:, None] + offset
    mask = torch.arange(S, device=q.device)[None, :] <= pos_q  # [T, S]
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    o = torch.einsum("bkgts,bskd->btkgd", p, _acc(v))
    return o.reshape(B, T, nh, d).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Blocks.


def mlp(w: MLPWeights, x: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, w.gate_proj)) * linear(x, w.up_proj), w.down_proj)


def attn_mixer(
    cfg: ModelConfig,
    w: AttnWeights,
    x: torch.Tensor,
    start: int,
    kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gated attention over x [B, T, H] at positions start.. ; kv = the layer's cache buffers (B = 1)."""
    B, T, _ = x.shape
    nh, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    qg = linear(x, w.q_proj).view(B, T, nh, 2 * d)  # per head [query d | gate d]
    gate = qg[..., d:].reshape(B, T, nh * d)
    q = rmsnorm1p(qg[..., :d], w.q_norm, eps)  # [B, T, nh, d]
    k = rmsnorm1p(linear(x, w.k_proj).view(B, T, nkv, d), w.k_norm, eps)  # [B, T, nkv, d]
    v = linear(x, w.v_proj).view(B, T, nkv, d)
    pos = torch.arange(start, start + T, device=x.device)
    q = apply_partial_rope(q, pos, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    k = apply_partial_rope(k, pos, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    if kv is not None:
        kc, vc = kv
        kc[start : start + T] = k[0]
        vc[start : start + T] = v[0]
        k, v = kc[None, : start + T], vc[None, : start + T]
    o = attention(q, k, v, offset=start).reshape(B, T, nh * d)
    return linear(o * torch.sigmoid(gate), w.o_proj)


def gdn_mixer(
    cfg: ModelConfig,
    w: GDNWeights,
    x: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    recurrent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet over x [B, T, H]; returns (out [B, T, H], new conv state, new GDN state)."""
    B, T, _ = x.shape
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    mixed = linear(x, w.in_proj_qkv)  # [B, T, C] = [q | k | v]
    z = linear(x, w.in_proj_z).view(B, T, nv, dv)
    b, a = linear(x, w.in_proj_b), linear(x, w.in_proj_a)  # [B, T, nv]
    mixed, conv_state = causal_conv(mixed, w.conv1d, conv_state)
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, g, beta = gdn_prepare(q.view(B, T, nk, dk), k.view(B, T, nk, dk), a, b, w.A_log, w.dt_bias)
    rule = gdn_recurrent if recurrent else gdn_chunked
    o, state = rule(q, k, v.reshape(B, T, nv, dv), g, beta, state)  # o [B, T, nv, dv] f32
    y = gated_rmsnorm(o.to(x.dtype), z, w.norm, cfg.rms_norm_eps)  # HF rounds o to the model dtype first
    return linear(y.reshape(B, T, nv * dv), w.out_proj), conv_state, state


def _residual_mlp(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    return h + mlp(lw.mlp, rmsnorm1p(h, lw.post_attention_layernorm, cfg.rms_norm_eps))


# ---------------------------------------------------------------------------------------------
# The model.


def forward(
    cfg: ModelConfig, w: ModelWeights, ids: torch.Tensor, cache: Cache | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target model over ids [B, T]. Returns (logits [B, T, V] f32, hidden [B, T, H] = final-norm output).

    Without a cache: a pure, differentiable forward from position 0. With a cache (B = 1): starts at
    cache.length, appends K/V, updates GDN and conv state, advances cache.length.
    """
    B, T = ids.shape
    start = 0
    if cache is not None:
        if B != 1:
            raise ValueError(f"a Cache holds one sequence, got a batch of {B}")
        start = cache.length
        if start + T > cache.max_len:
            raise ValueError(f"cache overflow: {start} + {T} tokens > max_len {cache.max_len}")
    h = w.embed_tokens[ids]  # [B, T, H]
    i_full = i_gdn = 0
    for kind, lw in zip(cfg.layer_types, w.layers, strict=True):
        x = rmsnorm1p(h, lw.input_layernorm, cfg.rms_norm_eps)
        if kind == FULL:
            kv = None if cache is None else (cache.kv_k[i_full], cache.kv_v[i_full])
            h = h + attn_mixer(cfg, lw.mixer, x, start, kv)
            i_full += 1
        elif cache is None:
            h = h + gdn_mixer(cfg, lw.mixer, x)[0]
        else:
            cs, ss = cache.conv_state[i_gdn], cache.gdn_state[i_gdn]
            y, new_cs, new_ss = gdn_mixer(cfg, lw.mixer, x, cs[None], ss[None], recurrent=T == 1)
            cs.copy_(new_cs[0])
            ss.copy_(new_ss[0])
            h = h + y
            i_gdn += 1
        h = _residual_mlp(cfg, lw, h)
    hidden = rmsnorm1p(h, w.norm, cfg.rms_norm_eps)
    if cache is not None:
        cache.length = start + T
    return _acc(linear(hidden, w.lm_head)), hidden


def mtp_forward(
    cfg: ModelConfig,
    w: ModelWeights,
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    cache: Cache | None = None,
    start_pos: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP head: pair t is (h_p, x_{p+1}) at RoPE position p = start + t; its logits predict x_{p+2}.

    hidden [B, T, H] (final-norm outputs, or a previous MTP `out`); next_ids [B, T].
    Returns (logits [B, T, V] f32, out [B, T, H]). With a cache (B = 1) the MTP K/V go to positions
    start_pos.. (default cache.mtp_length, earlier K/V are kept) and mtp_length becomes start_pos + T;
    without one it is causal self-attention over the T pairs from position 0.
    """
    if w.mtp is None:
        raise ValueError("these weights have no MTP head (mtp.* tensors)")
    B, T = next_ids.shape
    start = 0
    if cache is not None:
        if B != 1:
            raise ValueError(f"a Cache holds one sequence, got a batch of {B}")
        start = cache.mtp_length if start_pos is None else start_pos
        if len(cache.mtp_k) < len(w.mtp.layers):
            raise ValueError("this Cache has no MTP K/V buffers (config mtp_num_hidden_layers is 0)")
        if start + T > cache.max_len:
            raise ValueError(f"MTP cache overflow: {start} + {T} tokens > max_len {cache.max_len}")
    m, eps = w.mtp, cfg.rms_norm_eps
    e = rmsnorm1p(w.embed_tokens[next_ids].to(hidden.dtype), m.pre_fc_norm_embedding, eps)
    x = linear(torch.cat([e, rmsnorm1p(hidden, m.pre_fc_norm_hidden, eps)], dim=-1), m.fc)  # embedding FIRST
    # Published checkpoints have one MTP layer; more would be applied as a stack (unverified).
    for i, lw in enumerate(m.layers):
        kv = None if cache is None else (cache.mtp_k[i], cache.mtp_v[i])
        x = x + attn_mixer(cfg, lw.mixer, rmsnorm1p(x, lw.input_layernorm, eps), start, kv)
        x = _residual_mlp(cfg, lw, x)
    out = rmsnorm1p(x, m.norm, eps)
    if cache is not None:
        cache.mtp_length = start + T
    return _acc(linear(out, w.lm_head)), out
