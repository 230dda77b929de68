"""bench/train_tiny.py --smoke on the CPU: it trains, the loss falls, and the export loads in lumo."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lumo.config import FULL
from lumo.model import forward, mtp_forward
from lumo.weights import load_model

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train_tiny")
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "train_tiny.py"),
        "--out",
        str(out),
        "--smoke",
        "--device",
        "cpu",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out


def test_outputs_and_loss_falls(smoke: Path) -> None:
    assert {p.name for p in (smoke / "lumo-tiny").iterdir()} == FILES
    assert (smoke / "train_log.txt").read_text().count("step") >= 2
    m = json.loads((smoke / "metrics.json").read_text())
    tr = m["train"]
    assert tr["steps"] > 0 and tr["tokens_per_s"] > 0
    assert tr["final_loss"] < tr["first_loss"] - 0.5, (tr["first_loss"], tr["final_loss"])
    ho, sp = m["held_out"], m["speculation"]
    assert ho["loss"] < math.log(m["model"]["config"]["vocab_size"])  # better than uniform on unseen files
    assert 0.0 <= ho["mtp_top1"] <= ho["mtp_top3"] <= 1.0
    assert 0.0 <= sp["mean_accepted"] <= sp["drafts"] and sum(sp["histogram"]) == sp["positions"]


def test_export_loads_in_lumo(smoke: Path) -> None:
    ckpt = smoke / "lumo-tiny"
    cfg, w = load_model(ckpt, progress=False)
    assert cfg.model_type == "qwen3_5_text" and not cfg.tie_word_embeddings
    assert cfg.layer_types.count(FULL) >= 2 and cfg.mtp_num_hidden_layers == 1 and w.mtp is not None
    assert cfg.linear_num_value_heads in (2 * cfg.linear_num_key_heads, 3 * cfg.linear_num_key_heads)
    assert 0 < cfg.partial_rotary_factor < 1
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg.vocab_size
    for t in (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
    ):
        assert tok.token_to_id(t) is not None, t
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"]
    ids = torch.tensor([tok.encode("import os\n\ndef main():\n    return 0\n").ids])
    logits, hidden = forward(cfg, w, ids)
    mlog, _ = mtp_forward(cfg, w, hidden[:, :-1], ids[:, 1:])
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()
    assert torch.isfinite(mlog).all()
