"""The embedded default model (lumo/assets/lumo-tiny): transformers and lumo agree on it; it ships small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import lumo
from lumo.model import forward, new_cache
from lumo.weights import load_model

ASSETS = Path(lumo.__file__).resolve().parent / "assets"
TINY = ASSETS / "lumo-tiny"
TINY_NVFP4 = ASSETS / "lumo-tiny-nvfp4"
PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.",
    "for i, line in enumerate(open(path)):\n    if line.startswith('#'):\n",
    '"""Utilities for parsing dates."""\nfrom __future__ import annotations\n',
)
MAX_BYTES = 16 * 2**20  # both copies together

pytestmark = pytest.mark.skipif(
    not (TINY / "config.json").is_file(),
    reason="lumo/assets/lumo-tiny is absent: train it with bench/train_tiny.py, copy it in "
    "(docs/embedded-model.md)",
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


@pytest.fixture(scope="module")
def lumo_model():
    return load_model(TINY, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3_5ForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()


def test_architecture_and_size(lumo_model) -> None:
    cfg, w = lumo_model
    raw = json.loads((TINY / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and raw["architectures"] == ["Qwen3_5ForCausalLM"]
    full = cfg.full_attention_layers
    assert len(full) >= 2 and full == tuple(range(3, cfg.num_layers, 4))  # the 3:1 pattern
    assert cfg.linear_num_value_heads in (2 * cfg.linear_num_key_heads, 3 * cfg.linear_num_key_heads)
    assert 0 < cfg.partial_rotary_factor < 1 and not cfg.tie_word_embeddings
    assert cfg.mtp_num_hidden_layers == 1 and w.mtp is not None
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (TINY / name).is_file(), name
    assert "<|im_start|>" in json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]
    total = sum(
        f.stat().st_size for d in (TINY, TINY_NVFP4) if d.is_dir() for f in d.rglob("*") if f.is_file()
    )
    assert total <= MAX_BYTES, f"{total / 2**20:.2f} MiB of embedded model files > 16 MiB"


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"prompt{i}" for i in range(len(PROMPTS))])
def test_logits_match_transformers(prompt: str, tok: Tokenizer, lumo_model, hf_model) -> None:
    cfg, w = lumo_model
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        ref = hf_model(ids).logits.float()  # [1, T, V]
        got, _ = forward(cfg, w, ids)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"


def lumo_greedy(cfg, w, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """Greedy decoding through the cache path: chunked prefill, then one token at a time."""
    cache = new_cache(cfg, len(ids) + n, dtype=torch.float32)
    out: list[int] = []
    x = torch.tensor([ids])
    for _ in range(n):
        logits, _ = forward(cfg, w, x, cache)
        t = int(logits[0, -1].argmax())
        out.append(t)
        if t in eos:
            break
        x = torch.tensor([[t]])
    return out


def test_greedy_fibonacci_matches_transformers(tok: Tokenizer, lumo_model, hf_model) -> None:
    cfg, w = lumo_model
    ids = tok.encode("def fibonacci(n):").ids
    eos = set(cfg.eos_token_ids)
    n = 32
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(eos), pad_token_id=0
        )[0, len(ids) :].tolist()
        got = lumo_greedy(cfg, w, ids, n, eos)
    assert got == ref, f"lumo {tok.decode(got)!r} != transformers {tok.decode(ref)!r}"
    assert len(got) >= 8  # a real continuation, not an immediate end of text


@pytest.mark.skipif(
    not (TINY_NVFP4 / "config.json").is_file(), reason="lumo/assets/lumo-tiny-nvfp4 is absent"
)
def test_nvfp4_copy_tracks_bf16(tok: Tokenizer, lumo_model) -> None:
    cfg, w = lumo_model
    qcfg, qw = load_model(TINY_NVFP4, dtype=torch.float32, progress=False)
    assert qcfg.layer_types == cfg.layer_types and qw.mtp is not None
    ids = torch.tensor([tok.encode(PROMPTS[1]).ids])
    with torch.no_grad():
        ref, got = forward(cfg, w, ids)[0], forward(qcfg, qw, ids)[0]
    # 4-bit weights move the logits, but the model must still be the same model
    cos = torch.nn.functional.cosine_similarity(ref.flatten(0, 1), got.flatten(0, 1), dim=-1)
    assert cos.min() > 0.9, cos.min()
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.6
