"""The reference model (lumo.model) against transformers' Qwen3_5ForCausalLM on tiny random configs, fp32 CPU.

Errors are max|ours - ref| / max|ref| and are printed (run with -s). Every HF parameter is perturbed after
construction: HF initialises norms, A_log and dt_bias to constants, which would hide loader mix-ups.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from lumo import model as M
from lumo.config import ModelConfig
from lumo.weights import ModelWeights, build_weights, dense_linear_builder

transformers = pytest.importorskip("transformers")

TOL = 1e-5

# (value/key head ratio r, layer pattern: L = Gated DeltaNet, F = gated attention, partial rotary factor,
#  attention heads nh, kv heads nkv)
CASES = [
    (1, "LLLF", 0.25, 4, 2),
    (2, "LFLLLF", 0.5, 4, 1),
    (3, "FLLFL", 1.0, 2, 2),
    (2, "LLLFLLLF", 0.25, 6, 2),
]
IDS = [f"r{r}-{pat}" for r, pat, *_ in CASES]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def perturb_(hf_model: torch.nn.Module, seed: int) -> None:
    """Give every parameter distinct random values. Matrices get gain 0.5 (std 0.5/sqrt(fan_in)) and decays
    stay moderate, like a trained model: with gain 1 these random nets amplify fp32 rounding ~100x, and an
    error bound would then measure the net's conditioning instead of the implementation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).mul(1.9).add(0.1).log())  # A in [0.1, 2]
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * r)
            elif p.dim() == 1:  # norm weights (1+w kind and the GDN's plain-weight norm)
                p.add_(0.3 * r)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(r)
            else:
                p.copy_(0.5 * r * p.shape[-1] ** -0.5)


@functools.cache
def make_case(r: int, pattern: str, prf: float, nh: int, nkv: int, rope: tuple = (), max_pos: int = 32768):
    """rope: extra rope_parameters items (a scaling), max_pos: max_position_embeddings."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(1234)
    types = ["linear_attention" if c == "L" else "full_attention" for c in pattern]
    hf_cfg = Qwen3_5TextConfig(
        vocab_size=211,
        hidden_size=48,
        intermediate_size=72,
        num_hidden_layers=len(types),
        layer_types=types,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2 * r,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": prf,
            **dict(rope),
        },
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
    )
    hf = Qwen3_5ForCausalLM(hf_cfg).eval()
    perturb_(hf, seed=r * 100 + len(types))
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    assert cfg.gdn_ratio == r and cfg.rotary_dim == int(16 * prf) and cfg.layer_types == tuple(types)
    sd = hf.state_dict()
    w = build_weights(cfg, sd.get, dense_linear_builder(sd.get), prefix="model.")
    return hf, cfg, w


def prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # lengths: a single token, odd short ones, and one crossing the 64-token GDN chunk
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (1, 9, 30, 77)]


def greedy(cfg: ModelConfig, w: ModelWeights, ids: torch.Tensor, n: int) -> list[int]:
    cache = M.new_cache(cfg, ids.shape[1] + n)
    logits, _ = M.forward(cfg, w, ids, cache)
    out = []
    for _ in range(n):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        logits, _ = M.forward(cfg, w, torch.tensor([[tok]]), cache)
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
@torch.no_grad()
def test_logits_match_hf(case):
    hf, cfg, w = make_case(*case)
    errs = []
    for ids in prompts(cfg.vocab_size, 1):
        ref = hf(ids).logits
        logits, hidden = M.forward(cfg, w, ids)
        assert logits.dtype == torch.float32 and hidden.shape == (1, ids.shape[1], cfg.hidden_size)
        errs.append(rel_err(logits[:, -1], ref[:, -1]))
    # the batched no-cache path (training) against HF's batch
    batch = torch.randint(0, cfg.vocab_size, (3, 21), generator=torch.Generator().manual_seed(2))
    ref_b = hf(batch).logits
    err_b = rel_err(M.forward(cfg, w, batch)[0][:, -1], ref_b[:, -1])
    print(f"\n{IDS[CASES.index(case)]}: last-position logits rel err {max(errs):.2e} (batch {err_b:.2e})")
    assert max(errs) < TOL and err_b < TOL


# RoPE scalings a config may ask for (lumo.rope), with a short original context so that positions < 90
# reach the interpolated frequencies: Qwen's YaRN recipe (factor, original context), yarn's other knobs,
# a factor taken from max_position_embeddings / original, linear
SCALINGS = [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 131072),
    ({"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3}, 64),
    ({"rope_type": "yarn", "factor": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}, 48),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 24}, 96),
    ({"rope_type": "linear", "factor": 3.0}, 32768),
]


@pytest.mark.parametrize(
    "scaling, max_pos", SCALINGS, ids=["yarn-qwen", "yarn-betas", "yarn-mscale", "yarn-ratio", "linear"]
)
@torch.no_grad()
def test_scaled_rope_matches_hf(scaling, max_pos):
    """linear / yarn RoPE as transformers computes it (inv_freq and the attention factor on cos / sin);
    the same model read without its scaling would be far off."""
    hf, cfg, w = make_case(2, "LFLLLF", 0.5, 4, 1, tuple(scaling.items()), max_pos)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == scaling["rope_type"]
    ids = torch.randint(0, cfg.vocab_size, (1, 90), generator=torch.Generator().manual_seed(5))
    ref = hf(ids).logits
    err = rel_err(M.forward(cfg, w, ids)[0], ref)
    unscaled = rel_err(M.forward(replace(cfg, rope_scaling=None), w, ids)[0], ref)
    print(f"\n{scaling}: rel err {err:.2e} (unscaled {unscaled:.2e})")
    assert err < TOL and unscaled > 100 * TOL


@torch.no_grad()
def test_parity_detects_loader_mixups():
    """The comparison above can fail: typical loader/transcription mix-ups move the logits far beyond TOL."""
    hf, cfg, w = make_case(*CASES[1])
    ids = prompts(cfg.vocab_size, 1)[2]
    ref = hf(ids).logits[:, -1]
    gi = cfg.layer_types.index("linear_attention")
    ai = cfg.layer_types.index("full_attention")
    gdn, att = w.layers[gi].mixer, w.layers[ai].mixer
    mixups = {
        "swap in_proj_a/b": (gi, replace(gdn, in_proj_a=gdn.in_proj_b, in_proj_b=gdn.in_proj_a)),
        "swap A_log/dt_bias": (gi, replace(gdn, A_log=gdn.dt_bias, dt_bias=gdn.A_log)),
        "gated norm as 1+w": (gi, replace(gdn, norm=gdn.norm + 1)),
        "swap q_norm/k_norm": (ai, replace(att, q_norm=att.k_norm, k_norm=att.q_norm)),
    }
    for name, (i, mixer) in mixups.items():
        layers = list(w.layers)
        layers[i] = replace(layers[i], mixer=mixer)
        err = rel_err(M.forward(cfg, replace(w, layers=layers), ids)[0][:, -1], ref)
        assert err > 100 * TOL, f"{name} went unnoticed (rel err {err:.1e})"


@pytest.mark.parametrize("case", CASES, ids=IDS)
@torch.no_grad()
def test_all_positions_at_fp32_noise_floor(case):
    """Every position of a 77-token prompt: our fp32 error against our own float64 run is no worse than
    HF's fp32 error against it (the tiny random models amplify rounding to ~1e-5, so a fixed bound on all
    positions would measure the models' conditioning, not the implementation)."""
    hf, cfg, w = make_case(*case)
    ids = prompts(cfg.vocab_size, 3)[-1]
    sd64 = {k: v.double() for k, v in hf.state_dict().items()}
    w64 = build_weights(cfg, sd64.get, dense_linear_builder(sd64.get))
    exact = M.forward(cfg, w64, ids)[0]
    ours, ref = M.forward(cfg, w, ids)[0], hf(ids).logits
    e_ours, e_hf = rel_err(ours, exact), rel_err(ref, exact)
    print(f"\n{IDS[CASES.index(case)]}: all positions vs fp64: ours {e_ours:.2e}, HF {e_hf:.2e}")
    # the second bound keeps the float64 run honest: it must agree with HF up to HF's own rounding
    assert e_ours < max(2 * e_hf, TOL) and e_hf < 1e-4


@pytest.mark.parametrize("case", CASES, ids=IDS)
@torch.no_grad()
def test_prefill_then_decode_equals_full(case):
    hf, cfg, w = make_case(*case)
    ids = torch.randint(0, cfg.vocab_size, (1, 90), generator=torch.Generator().manual_seed(4))
    full, full_h = M.forward(cfg, w, ids)
    ref = hf(ids).logits
    cache = M.new_cache(cfg, 96)
    steps = [M.forward(cfg, w, ids[:, :70], cache)]  # chunked prefill from a zero state (2 chunks)
    steps.append(M.forward(cfg, w, ids[:, 70:75], cache))  # chunked prefill from a non-zero state
    snap = cache.clone()
    for t in range(75, 90):  # the plain recurrence
        steps.append(M.forward(cfg, w, ids[:, t : t + 1], cache))
    assert cache.length == 90
    logits = torch.cat([s[0] for s in steps], dim=1)
    hidden = torch.cat([s[1] for s in steps], dim=1)
    # HF's own cached decode (its recurrent torch fallback) over the same split
    hf_cache = None
    hf_steps = []
    for a, b in [(0, 70), (70, 75), *((t, t + 1) for t in range(75, 90))]:
        out = hf(ids[:, a:b], cache=hf_cache, use_cache=True)
        hf_cache = out.cache
        hf_steps.append(out.logits)
    hf_dec = torch.cat(hf_steps, dim=1)
    e_full, e_h = rel_err(logits, full), rel_err(hidden, full_h)
    e_dec = rel_err(logits[:, 70:], hf_dec[:, 70:])
    print(
        f"\n{IDS[CASES.index(case)]}: cached vs full {e_full:.2e} (hidden {e_h:.2e}), "
        f"decode vs HF decode {e_dec:.2e}, vs HF full {rel_err(logits[:, 70:], ref[:, 70:]):.2e}"
    )
    assert e_full < TOL and e_h < TOL and e_dec < TOL
    # a snapshot replays to the same state bit for bit
    replay = [M.forward(cfg, w, ids[:, t : t + 1], snap)[0] for t in range(75, 90)]
    assert torch.equal(torch.cat(replay, dim=1), logits[:, 75:])


@pytest.mark.parametrize("case", CASES, ids=IDS)
@torch.no_grad()
def test_greedy_matches_hf(case):
    hf, cfg, w = make_case(*case)
    n = 12
    for ids in prompts(cfg.vocab_size, 5)[1:3]:
        ref = hf.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)[
            0, ids.shape[1] :
        ].tolist()
        assert greedy(cfg, w, ids, n) == ref


def test_backward_matches_hf():
    """The no-cache forward is differentiable: gradients of a next-token loss equal HF's autograd ones."""
    hf, cfg, _ = make_case(*CASES[1])
    params = {k: v.detach().clone().requires_grad_(True) for k, v in hf.state_dict().items()}
    w = build_weights(cfg, params.get, dense_linear_builder(params.get))
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(6))
    loss = torch.nn.functional.cross_entropy(
        M.forward(cfg, w, ids[:, :-1])[0].flatten(0, 1), ids[:, 1:].flatten()
    )
    loss.backward()
    hf.zero_grad()
    ref_loss = torch.nn.functional.cross_entropy(hf(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
    ref_loss.backward()
    hf_grads = dict(hf.named_parameters())
    worst = max(rel_err(params[k].grad, hf_grads[k].grad) for k in hf_grads)
    print(f"\nbackward: loss rel err {rel_err(loss, ref_loss):.2e}, worst grad rel err {worst:.2e}")
    assert all(params[k].grad is not None for k in hf_grads)
    assert worst < 1e-4  # gradients pass through the same fp32 noise, amplified by the backward


@torch.no_grad()
def test_bfloat16_close_to_fp32():
    """bf16 weights and activations: bounded by bf16 rounding (2^-8 per op over a few layers), not by TOL."""
    hf, cfg, w = make_case(*CASES[1])
    sd = {k: v.bfloat16() for k, v in hf.state_dict().items()}
    wb = build_weights(cfg, sd.get, dense_linear_builder(sd.get))
    ids = prompts(cfg.vocab_size, 7)[-1]
    ref = M.forward(cfg, w, ids)[0]
    logits, hidden = M.forward(cfg, wb, ids)
    assert logits.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    cache = M.new_cache(cfg, ids.shape[1], dtype=torch.bfloat16)
    steps = [M.forward(cfg, wb, ids[:, :70], cache)[0]]
    steps += [M.forward(cfg, wb, ids[:, t : t + 1], cache)[0] for t in range(70, ids.shape[1])]
    e32, e_cache = rel_err(logits, ref), rel_err(torch.cat(steps, dim=1), logits)
    print(f"\nbf16: vs fp32 {e32:.2e}, cached vs full {e_cache:.2e}")
    assert e32 < 3e-2 and e_cache < 1e-2


@pytest.mark.parametrize(
    "T,nk,nv,dk,dv,chunk", [(1, 1, 1, 5, 7, 64), (37, 2, 6, 8, 12, 8), (130, 3, 3, 16, 9, 64)]
)
def test_gdn_chunked_equals_recurrent(T, nk, nv, dk, dv, chunk):
    g = torch.Generator().manual_seed(T)
    B = 2
    q, k = torch.randn(B, T, nk, dk, generator=g), torch.randn(B, T, nk, dk, generator=g)
    a, b = torch.randn(B, T, nv, generator=g), torch.randn(B, T, nv, generator=g)
    A_log, dt_bias = torch.rand(nv, generator=g).log(), torch.randn(nv, generator=g)
    v = torch.randn(B, T, nv, dv, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, nv, dk, dv, generator=g, dtype=torch.float64)
    q, k, gg, beta = M.gdn_prepare(
        q.double(), k.double(), a.double(), b.double(), A_log.double(), dt_bias.double()
    )
    o_ref, s_ref = M.gdn_recurrent(q, k, v, gg, beta, s0)  # float64 ground truth
    args32 = [t.float() for t in (q, k, v, gg, beta, s0)]
    o_c, s_c = M.gdn_chunked(*args32, chunk=chunk)
    o_r, s_r = M.gdn_recurrent(*args32)
    errs = [rel_err(o_c, o_ref), rel_err(s_c, s_ref), rel_err(o_r, o_ref), rel_err(s_r, s_ref)]
    print(f"\ngdn T{T}-nk{nk}-nv{nv}-dk{dk}-dv{dv}: chunked o/S {errs[0]:.1e}/{errs[1]:.1e}")
    assert o_c.dtype == torch.float32 and max(errs) < TOL


def test_causal_conv_streaming():
    g = torch.Generator().manual_seed(0)
    C, K, T = 11, 4, 13
    x, w = torch.randn(T, C, generator=g), torch.randn(C, K, generator=g)
    y, state = M.causal_conv(x, w)
    # direct definition: y_t = silu(sum_j w[:, j] * x_{t-K+1+j}) with zeros before the start
    xp = torch.cat([torch.zeros(K - 1, C), x])
    direct = torch.nn.functional.silu(torch.stack([(xp[t : t + K].T * w).sum(-1) for t in range(T)]))
    assert rel_err(y, direct) < 1e-6 and torch.equal(state, x[-(K - 1) :].T)
    parts, s = [], None
    for a, b in [(0, 2), (2, 3), (3, 9), (9, 13)]:  # pieces shorter than K-1 too
        yp, s = M.causal_conv(x[a:b], w, s)
        parts.append(yp)
    assert rel_err(torch.cat(parts), y) < 1e-6 and torch.equal(s, state)
