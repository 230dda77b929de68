"""lumo.model.mtp_forward against a direct, token-by-token float64 transcription of MODEL.md's MTP head.

The transcription below reads the raw `mtp.*` tensors by name and shares no code with lumo.model.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lumo import model as M
from lumo.config import ModelConfig
from lumo.weights import build_weights, dense_linear_builder

pytest.importorskip("transformers")

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@functools.cache
def make_model():
    """Tiny target from transformers (random, every tensor perturbed) plus random `mtp.*` tensors."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(7)
    hf_cfg = Qwen3_5TextConfig(
        vocab_size=157,
        hidden_size=40,
        intermediate_size=56,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
    )
    hf = Qwen3_5ForCausalLM(hf_cfg)
    g = torch.Generator().manual_seed(8)
    H, nh, nkv, d, I = 40, 4, 2, 12, 56  # noqa: E741
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.q_proj.weight": (nh * 2 * d, H),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * d, H),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * d, H),
        "mtp.layers.0.self_attn.o_proj.weight": (H, nh * d),
        "mtp.layers.0.self_attn.q_norm.weight": (d,),
        "mtp.layers.0.self_attn.k_norm.weight": (d,),
        "mtp.layers.0.mlp.gate_proj.weight": (I, H),
        "mtp.layers.0.mlp.up_proj.weight": (I, H),
        "mtp.layers.0.mlp.down_proj.weight": (H, I),
    }
    for name, shape in shapes.items():
        sd[name] = torch.randn(shape, generator=g) * (0.3 if len(shape) == 1 else 0.5 * shape[-1] ** -0.5)
    for name, t in sd.items():  # the target too: HF's constant inits would hide mix-ups
        if not name.startswith("mtp."):
            r = torch.randn(t.shape, generator=g)
            if name.endswith("A_log"):
                t.copy_(torch.rand(t.shape, generator=g).mul(1.9).add(0.1).log())
            elif t.dim() == 1:
                t.add_(0.3 * r)
            else:
                t.copy_(r if "embed" in name else 0.5 * r * t.shape[-1] ** -0.5)
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "mtp_num_hidden_layers": 1})
    w = build_weights(cfg, sd.get, dense_linear_builder(sd.get), prefix="model.")
    assert w.mtp is not None
    return cfg, w, sd


class Transcription:
    """MODEL.md 'MTP head', one token at a time, float64, with its own K/V list."""

    def __init__(
        self, cfg: ModelConfig, sd: dict, embedding_first: bool = True, shift_from: int | None = None
    ):
        self.c, self.kv = cfg, []
        self.t = {
            k: v.double() for k, v in sd.items() if k.startswith("mtp.") or k.endswith("embed_tokens.weight")
        }
        self.lm_head = sd["lm_head.weight"].double()
        self.embedding_first, self.shift_from = embedding_first, shift_from

    def n1p(self, x, name):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.c.rms_norm_eps) * (1 + self.t[name])

    def rope(self, x, p):  # x [heads, d]: pairs (i, i + rd/2) for i < rd/2
        rd, out = self.c.rotary_dim, x.clone()
        for i in range(rd // 2):
            ang = p * self.c.rope_theta ** (-2 * i / rd)
            a, b = x[:, i], x[:, i + rd // 2]
            out[:, i], out[:, i + rd // 2] = (
                a * math.cos(ang) - b * math.sin(ang),
                b * math.cos(ang) + a * math.sin(ang),
            )
        return out

    def step(self, h_p: torch.Tensor, tok: int, p: int):
        c, t, L = self.c, self.t, "mtp.layers.0."
        if self.shift_from is not None and p >= self.shift_from:  # a deliberately wrong variant
            p += 1
        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        e = self.n1p(t["model.embed_tokens.weight"][tok], "mtp.pre_fc_norm_embedding.weight")
        hn = self.n1p(h_p.double(), "mtp.pre_fc_norm_hidden.weight")
        x = t["mtp.fc.weight"] @ (torch.cat([e, hn]) if self.embedding_first else torch.cat([hn, e]))
        a = self.n1p(x, L + "input_layernorm.weight")
        qg = (t[L + "self_attn.q_proj.weight"] @ a).view(nh, 2 * d)
        q = self.rope(self.n1p(qg[:, :d], L + "self_attn.q_norm.weight"), p)
        k = self.n1p((t[L + "self_attn.k_proj.weight"] @ a).view(nkv, d), L + "self_attn.k_norm.weight")
        self.kv.append((self.rope(k, p), (t[L + "self_attn.v_proj.weight"] @ a).view(nkv, d)))
        o = torch.empty(nh, d, dtype=torch.float64)
        for hq in range(nh):
            j = hq // (nh // nkv)
            s = torch.stack([q[hq] @ kk[j] for kk, _ in self.kv]) / math.sqrt(d)
            o[hq] = sum(pj * vv[j] for pj, (_, vv) in zip(torch.softmax(s, 0), self.kv, strict=True))
        x = x + t[L + "self_attn.o_proj.weight"] @ (o * torch.sigmoid(qg[:, d:])).reshape(-1)
        b = self.n1p(x, L + "post_attention_layernorm.weight")
        gate, up = t[L + "mlp.gate_proj.weight"] @ b, t[L + "mlp.up_proj.weight"] @ b
        x = x + t[L + "mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up)
        out = self.n1p(x, "mtp.norm.weight")
        return self.lm_head @ out, out


def prompt(cfg: ModelConfig, n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_mtp_training_path_matches_transcription():
    """No cache: pairs (h_p, x_{p+1}) at positions p = 0..T-1, causal; vectorised over a batch."""
    cfg, w, sd = make_model()
    ids = prompt(cfg, 23, seed=1, batch=2)
    _, hidden = M.forward(cfg, w, ids)
    logits, out = M.mtp_forward(cfg, w, hidden[:, :-1], ids[:, 1:])
    assert logits.shape == (2, 22, cfg.vocab_size) and out.shape == (2, 22, cfg.hidden_size)
    worst = 0.0
    for bi in range(2):
        ref = Transcription(cfg, sd)
        steps = [ref.step(hidden[bi, p], int(ids[bi, p + 1]), p) for p in range(22)]
        worst = max(worst, rel_err(logits[bi], torch.stack([s[0] for s in steps])))
        worst = max(worst, rel_err(out[bi], torch.stack([s[1] for s in steps])))
    print(f"\nMTP (no cache, B=2, T=22) vs MODEL.md transcription: rel err {worst:.2e}")
    assert worst < TOL


@torch.no_grad()
def test_mtp_cached_draft_chain_matches_transcription():
    """Prefill the MTP KV with the prompt's pairs, then draft a chain feeding back `out` and the argmax."""
    cfg, w, sd = make_model()
    P, D = 17, 6
    ids = prompt(cfg, P, seed=2)
    cache = M.new_cache(cfg, P + D + 2)
    logits, hidden = M.forward(cfg, w, ids, cache)
    M.mtp_forward(cfg, w, hidden[:, :-1], ids[:, 1:], cache)  # pairs for positions 0..P-2
    assert cache.mtp_length == P - 1
    ref = Transcription(cfg, sd)
    for p in range(P - 1):
        ref.step(hidden[0, p], int(ids[0, p + 1]), p)
    h, tok = hidden[:, -1:], logits[:, -1:].argmax(-1)  # target's h_{P-1} and its next token x_P
    h_ref, tok_ref, errs, chain, chain_ref = h[0, 0], int(tok), [], [], []
    for step in range(D):
        lg, h = M.mtp_forward(cfg, w, h, tok, cache)
        lg_ref, h_ref = ref.step(h_ref, tok_ref, P - 1 + step)
        errs.append(rel_err(lg[0, 0], lg_ref))
        tok, tok_ref = lg.argmax(-1), int(lg_ref.argmax())
        chain.append(int(tok))
        chain_ref.append(tok_ref)
    assert cache.mtp_length == P - 1 + D
    print(f"\nMTP cached draft chain of {D}: max rel err {max(errs):.2e}, tokens {chain}")
    assert max(errs) < TOL and chain == chain_ref


@torch.no_grad()
def test_mtp_start_pos_rewrites_and_cache_clone():
    cfg, w, _ = make_model()
    ids = prompt(cfg, 12, seed=3)
    cache = M.new_cache(cfg, 16)
    _, hidden = M.forward(cfg, w, ids, cache)
    M.mtp_forward(cfg, w, hidden[:, :-1], ids[:, 1:], cache)
    snap = cache.clone()
    first, _ = M.mtp_forward(cfg, w, hidden[:, -1:], torch.tensor([[5]]), cache)
    M.mtp_forward(cfg, w, hidden[:, -1:], torch.tensor([[9]]), cache)  # a draft at position 12, then rewind
    again, _ = M.mtp_forward(cfg, w, hidden[:, -1:], torch.tensor([[5]]), cache, start_pos=11)
    fresh, _ = M.mtp_forward(cfg, w, hidden[:, -1:], torch.tensor([[5]]), snap)
    assert cache.mtp_length == 12 and snap.mtp_length == 12
    assert torch.equal(first, again) and torch.equal(first, fresh)
    assert not torch.equal(snap.mtp_k[0], M.new_cache(cfg, 16).mtp_k[0])


@pytest.mark.parametrize("variant", ["hidden-first", "drafts-at-p+1"])
@torch.no_grad()
def test_transcription_distinguishes_conventions(variant):
    """The checks above would catch the easy MTP mistakes: the concat order, and drafts placed one position
    off from the prefilled pairs. (A uniform shift of every position is invisible: RoPE is relative.)"""
    cfg, w, sd = make_model()
    ids = prompt(cfg, 9, seed=4)
    _, hidden = M.forward(cfg, w, ids)
    logits, _ = M.mtp_forward(cfg, w, hidden[:, :-1], ids[:, 1:])
    kw = {"embedding_first": False} if variant == "hidden-first" else {"shift_from": 5}
    wrong = Transcription(cfg, sd, **kw)
    ref = torch.stack([wrong.step(hidden[0, p], int(ids[0, p + 1]), p)[0] for p in range(8)])
    assert rel_err(logits[0], ref) > 100 * TOL


def test_mtp_errors_are_one_line():
    cfg, w, _ = make_model()
    ids = prompt(cfg, 4, seed=5, batch=2)
    hidden = torch.zeros(2, 4, cfg.hidden_size)
    with pytest.raises(ValueError, match="one sequence"):
        M.mtp_forward(cfg, w, hidden, ids, M.new_cache(cfg, 8))
    from dataclasses import replace

    with pytest.raises(ValueError, match="no MTP head"):
        M.mtp_forward(cfg, replace(w, mtp=None), hidden, ids)
    with pytest.raises(ValueError, match="overflow"):
        M.forward(cfg, w, ids[:1], M.new_cache(cfg, 3))
