from __future__ import annotations

import json
import math
import time

import pytest
import torch
from safetensors.torch import load_file

from lumo.config import FULL, ModelConfig
from lumo.testing import make_tiny_checkpoint
from lumo.tokenizer import Tokenizer
from lumo.weights import AttnWeights, GDNWeights, build_weights, dense_linear_builder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def test_config_and_tokenizer_agree(ckpt):
    d = json.loads((ckpt / "config.json").read_text())
    tok = Tokenizer.from_dir(ckpt)
    cfg = ModelConfig.from_hf(d)
    assert cfg.vocab_size == tok.vocab_size
    assert (
        cfg.eos_token_ids
        == tok.eos_token_ids
        == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    )
    assert cfg.layer_types == ("linear_attention",) * 3 + (FULL,) + ("linear_attention",) * 3 + (FULL,)
    assert (cfg.hidden_size, cfg.head_dim, cfg.rotary_dim, cfg.conv_dim, cfg.mtp_num_hidden_layers) == (
        64,
        16,
        4,
        128,
        1,
    )
    assert not cfg.tie_word_embeddings and tok.has_chat_template


def test_loads_in_transformers(ckpt):
    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    sd = load_file(ckpt / "model.safetensors")
    for name, t in model.state_dict().items():
        assert torch.equal(t, sd[name]), name  # every parameter came from the file, none was initialised
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([[1, 50, 120, 7, 299]])
    logits = model(ids).logits
    assert logits.shape == (1, 5, 300) and torch.isfinite(logits).all()


def test_build_weights(ckpt):
    sd = load_file(ckpt / "model.safetensors")
    cfg = ModelConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    w = build_weights(cfg, sd.get, dense_linear_builder(sd.get))
    assert len(w.layers) == 8 and w.mtp is not None and len(w.mtp.layers) == 1
    for layer, kind in zip(w.layers, cfg.layer_types, strict=True):
        assert isinstance(layer.mixer, AttnWeights if kind == FULL else GDNWeights)
    assert w.lm_head.shape == (300, 64) and w.mtp.fc.shape == (64, 128)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    names = set(sd)
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in names)
    assert all(
        n.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head", "mtp.")) for n in names
    )


def test_init_statistics(ckpt):
    sd = {k: v.float() for k, v in load_file(ckpt / "model.safetensors").items()}
    gdn = "model.layers.0.linear_attn"
    a_log = torch.cat([sd[f"model.layers.{i}.linear_attn.A_log"] for i in (0, 1, 2, 4, 5, 6)])
    assert a_log.min() >= 0 and a_log.max() <= math.log(16) + 1e-2 and a_log.std() > 0.2
    assert abs(sd["model.embed_tokens.weight"].std().item() - 0.02) < 0.002
    assert abs(sd[f"{gdn}.in_proj_qkv.weight"].std().item() - 0.02) < 0.003
    assert sd[f"{gdn}.conv1d.weight"].shape == (128, 1, 4)
    norm1p = sd["model.layers.0.input_layernorm.weight"]
    assert norm1p.abs().mean() < 0.3 and norm1p.std() > 0.01  # around 0 (used as 1 + w), not constant
    assert (sd[f"{gdn}.norm.weight"] - 1).abs().mean() < 0.3  # plain-weight GDN norm: around 1
    assert sd[f"{gdn}.dt_bias"].std() > 0


def test_deterministic_and_fast(tmp_path):
    t0 = time.perf_counter()
    a = make_tiny_checkpoint(tmp_path / "a", seed=3)
    elapsed = time.perf_counter() - t0
    b = make_tiny_checkpoint(tmp_path / "b", seed=3)
    c = make_tiny_checkpoint(tmp_path / "c", seed=4)
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    sa, sc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    assert elapsed < 2.0


def test_overrides(tmp_path):
    d = make_tiny_checkpoint(
        tmp_path, num_hidden_layers=4, tie_word_embeddings=True, mtp_num_hidden_layers=0, dtype="float32"
    )
    cfg = ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    sd = load_file(d / "model.safetensors")
    assert cfg.num_layers == 4 and cfg.full_attention_layers == (3,)
    assert "lm_head.weight" not in sd and not any(k.startswith("mtp.") for k in sd)
    assert {t.dtype for t in sd.values()} == {torch.float32}
    w = build_weights(cfg, sd.get, dense_linear_builder(sd.get))
    assert w.mtp is None and w.lm_head.weight is w.embed_tokens
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_checkpoint(tmp_path / "x", vocab_size=10)


def test_chat_template_matches_transformers(ckpt):
    # Our jinja environment must render a checkpoint's template exactly as transformers does.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    tok = Tokenizer.from_dir(ckpt)
    tools = [{"type": "function", "function": {"name": "f", "description": "<x> & 'y'", "parameters": {}}}]
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "日本 😀?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "ok"},
    ]
    for kw in ({}, {"tools": tools}, {"add_generation_prompt": False}, {"enable_thinking": False}):
        ours = tok.apply_chat_template(msgs, **kw)
        kw = {"add_generation_prompt": True, **kw}
        assert ours == hf.apply_chat_template(msgs, tokenize=False, **kw)
        assert tok.encode(ours) == hf.encode(ours, add_special_tokens=False)
