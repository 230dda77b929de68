"""CPU: draft vocabularies (lumo.engine.draft_vocab): choosing the ids, the lm_head rows, and tree decoding
with one on the torch backend (output == plain decoding); user errors at start-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lumo.config import TreeConfig
from lumo.engine.draft_vocab import MIN_DRAFT_VOCAB, draft_vocab_ids, frequency_ranked_ids, main
from lumo.engine.llm import LLM, embedded_model_path
from lumo.quant import nvfp4_quantize
from lumo.weights import DenseLinear, FP8Linear, NVFP4Linear, linear_rows

EMBEDDED = (embedded_model_path() / "config.json").exists()


def test_size_keeps_the_added_tokens_and_the_lowest_ids():
    assert draft_vocab_ids(12, 100, keep=[99, 97, 5, 200]) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 97, 99]
    assert draft_vocab_ids("10", 100) == list(range(10))
    assert draft_vocab_ids(500, 100) == list(range(100))  # at most the vocabulary
    assert draft_vocab_ids(torch.tensor(9).numpy()[()], 100) == list(range(9))  # numpy integers too
    for bad in (MIN_DRAFT_VOCAB - 1, 0, True, 12.0, None):
        with pytest.raises(ValueError, match="draft vocabulary"):
            draft_vocab_ids(bad, 100)
    with pytest.raises(ValueError, match="added tokens"):
        draft_vocab_ids(8, 100, keep=range(90, 99))


def test_files_of_ids(tmp_path):
    ids = [40, 3, 3, 17, 9, 8, 7, 6, 5, 4]
    want = sorted(set(ids))
    (tmp_path / "a.json").write_text(json.dumps(ids))
    (tmp_path / "b.txt").write_text("40 3\n3,17\n9 8 7 6 5 4\n")
    torch.save(torch.tensor(ids), tmp_path / "c.pt")
    for name in ("a.json", "b.txt", "c.pt"):
        assert draft_vocab_ids(str(tmp_path / name), 50) == want, name
    (tmp_path / "bad.txt").write_text("3 4 five")
    torch.save(torch.ones(9, dtype=torch.bool), tmp_path / "bool.pt")
    (tmp_path / "float.pt").write_bytes(b"")
    torch.save(torch.ones(9), tmp_path / "float.pt")
    (tmp_path / "few.json").write_text("[1, 2]")
    cases = {
        "bad.txt": "expected token ids",
        "float.pt": "integer tensor",
        "bool.pt": "integer tensor",
        "few.json": "at least",
        "missing.json": "no such file",
        "a.json": "outside",  # id 40 >= vocabulary 20
    }
    for name, words in cases.items():
        with pytest.raises(ValueError, match=words):
            draft_vocab_ids(str(tmp_path / name), 20 if name == "a.json" else 50)


def test_frequency_ranking():
    lists = [[5, 5, 5, 9, 9, 2], [9, 7, 7, 1]]  # counts: 5: 3, 9: 3, 7: 2, 2: 1, 1: 1
    assert frequency_ranked_ids(lists, 2) == [5, 9]
    assert frequency_ranked_ids(lists, 4, keep=[100]) == [5, 7, 9, 100]
    assert frequency_ranked_ids(lists, 4) == [1, 5, 7, 9]  # ties: the lower id
    assert frequency_ranked_ids(lists, 50) == [1, 2, 5, 7, 9]


@pytest.mark.skipif(not EMBEDDED, reason="no embedded model")
def test_tool_writes_a_file_the_option_reads(tmp_path, capsys):
    text = tmp_path / "traffic.txt"
    text.write_text("def main(argv):\n    for name in argv:\n        print(name)\n" * 20)
    out = tmp_path / "ids.json"
    assert main([str(embedded_model_path()), "64", str(text), "-o", str(out)]) == 0
    assert "cover 100.0%" in capsys.readouterr().out  # fewer distinct tokens than 64: all kept
    ids = draft_vocab_ids(str(out), 3072)
    assert len(ids) <= 64 and {3065, 3066, 3067} <= set(ids)
    assert main([str(embedded_model_path()), "4", str(text), "-o", str(out)]) == 2
    assert main([str(embedded_model_path()), "64", str(tmp_path / "missing.txt"), "-o", str(out)]) == 2


def test_linear_rows_of_each_format():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=gen)
    rows = torch.tensor([0, 7, 8, 39])
    fp4 = NVFP4Linear(*nvfp4_quantize(w))
    fp8 = FP8Linear(w.to(torch.float8_e4m3fn), torch.tensor(0.5))
    for lin in (fp4, fp8, DenseLinear(w.to(torch.bfloat16))):
        sub = linear_rows(lin, rows)
        assert type(sub) is type(lin) and sub.shape == (4, 64)
        assert torch.equal(sub.dequantize(), lin.dequantize()[rows])


@pytest.mark.skipif(not EMBEDDED, reason="no embedded model")
def test_tree_decoding_with_a_draft_vocabulary_equals_plain():
    """The embedded model on the torch backend: greedy tree decoding with a draft vocabulary of 1024 of
    its 3072 tokens gives plain decoding's tokens; its drafts come from the vocabulary."""
    plain = LLM(spec="off", device="cpu")
    tree = LLM(spec="tree", device="cpu", draft_vocab=1024)
    assert len(tree.draft_ids) == 1024 and set(tree.tokenizer.added_token_ids()) <= set(tree.draft_ids)
    for prompt in ("def fibonacci(n):", "import numpy as np\n"):
        want = plain.generate(prompt, max_tokens=24, temperature=0).token_ids
        assert tree.generate(prompt, max_tokens=24, temperature=0).token_ids == want
        stats = tree.last_decoder.stats
        assert stats.events > 0 and sum(stats.accepted) > 0


@pytest.mark.skipif(not EMBEDDED, reason="no embedded model")
def test_user_errors():
    with pytest.raises(ValueError, match="needs speculative decoding"):
        LLM(spec="off", device="cpu", draft_vocab=64)
    wide = TreeConfig(depth=3, topk=12, budget=30, rows=32)  # 12 candidates per depth
    with pytest.raises(ValueError, match="top-12"):
        LLM(spec="tree", device="cpu", draft_vocab=8, tree=wide)
    r = subprocess.run(
        [sys.executable, "-m", "lumo.cli", "generate", "--prompt", "x", "--device", "cpu", "--spec", "tree",
         "--draft-vocab", "/no/such/ids.json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
