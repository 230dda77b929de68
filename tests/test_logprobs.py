"""Logprobs of emitted tokens (lumo.engine.logprobs) on the CPU: against a from-scratch forward, exact
between plain and speculative decoding and across a prefix-cache hit, cut like the tokens; token bytes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from lumo import model as M
from lumo.engine.llm import LLM
from lumo.engine.logprobs import MAX_LOGPROBS, TokenLogprob, token_logprobs
from lumo.testing import embedded_or_skip
from lumo.tokenizer import Tokenizer, _byte_level_alphabet

PROMPT = "def fibonacci(n):\n    "


@pytest.mark.parametrize("V, k", [(7, 0), (257, 5), (3001, 20), (5, 20)])
def test_token_logprobs_against_fp64(V, k):
    g = torch.Generator().manual_seed(V + k)
    rows = torch.randn(4, V, generator=g) * 6
    rows[1, 3] = -1e30  # a token the model all but rules out
    tokens = torch.randint(0, V, (4,), generator=g).tolist()
    tokens[1] = 3
    got = token_logprobs(rows.bfloat16(), tokens, k)
    ref = torch.log_softmax(rows.bfloat16().double(), dim=-1)
    for i, t in enumerate(got):
        assert t.token == tokens[i]
        assert math.isclose(t.logprob, float(ref[i, tokens[i]]), rel_tol=1e-5, abs_tol=1e-5)
        assert len(t.top) == min(k, V)
        ids = [j for j, _ in t.top]
        assert len(set(ids)) == len(ids)
        for j, v in t.top:
            assert math.isclose(v, float(ref[i, j]), rel_tol=1e-5, abs_tol=1e-5)
        best = ref[i].sort(descending=True).values[: len(t.top)]
        assert torch.allclose(torch.tensor([v for _, v in t.top], dtype=torch.float64), best, atol=1e-5)
    # a row's numbers do not depend on the rows beside it
    assert token_logprobs(rows[2:3].bfloat16(), tokens[2:3], k) == got[2:3]


@pytest.mark.parametrize("k", [0, 3])
def test_token_ranks_count_the_tokens_at_least_as_likely(k):
    """ranks=True (prompt tokens, vLLM's prompt_logprobs): each token's rank is the number of tokens whose
    logit is at least its own, itself included, ties counted (vLLM's count); the other numbers unchanged.
    Rows of few distinct values so ties are common; the reference counts in Python."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(-4, 5, (9, 37), generator=g).float() / 2
    tokens = torch.randint(0, 37, (9,), generator=g).tolist()
    got = token_logprobs(rows, tokens, k, row_by_row=False, ranks=True)
    for t, row in zip(got, rows.tolist(), strict=True):
        assert t.rank == sum(v >= row[t.token] for v in row) >= 1
    assert [replace(t, rank=None) for t in got] == token_logprobs(rows, tokens, k, row_by_row=False)
    top = max(range(37), key=lambda i: (rows[0, i].item(), -i))
    assert token_logprobs(rows[:1], [top], k, row_by_row=False, ranks=True)[0].rank == int(
        (rows[0] == rows[0, top]).sum()
    )
    with pytest.raises(ValueError, match="row_by_row"):
        token_logprobs(rows, tokens, k, ranks=True)


def test_token_logprobs_checks_its_rows():
    with pytest.raises(ValueError, match="2 logits rows for 1 tokens"):
        token_logprobs(torch.zeros(2, 5), [1], 0)
    assert token_logprobs(torch.zeros(0, 5), [], 3) == []


@pytest.fixture(scope="module")
def models():
    path = embedded_or_skip()
    return {spec: LLM(path, device="cpu", spec=spec) for spec in ("off", "tree", "chain")}


def _reference(llm: LLM, prompt_ids: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of one forward over prompt + output (no cache, no chunks): the row of each output token."""
    ids = torch.tensor([prompt_ids + out[:-1]])
    logits, _ = M.forward(llm.config, llm.weights, ids)
    return torch.log_softmax(logits[0, len(prompt_ids) - 1 :].double(), dim=-1)


@pytest.mark.parametrize(
    "kw", [dict(temperature=0), dict(temperature=0.9, top_k=40, seed=5)], ids=["greedy", "seeded"]
)
def test_plain_logprobs_match_a_fresh_forward(models, kw):
    llm = models["off"]
    r = llm.generate(PROMPT, max_tokens=24, logprobs=4, **kw)
    assert [t.token for t in r.logprobs] == r.token_ids
    ref = _reference(llm, r.prompt_token_ids, r.token_ids)
    for i, t in enumerate(r.logprobs):
        assert abs(t.logprob - float(ref[i, t.token])) < 1e-4
        assert [j for j, _ in t.top] == ref[i].topk(4).indices.tolist()
        if kw["temperature"] == 0:  # the greedy token is the most likely one
            assert t.top[0] == (t.token, t.logprob)


@pytest.mark.parametrize(
    "kw", [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=3)], ids=["greedy", "seeded"]
)
@pytest.mark.parametrize("spec", ["tree", "chain"])
def test_speculation_gives_plain_logprobs_exactly(models, spec, kw):
    """Events emit several tokens, each with its verify row's logprobs: equal (==) to plain decoding's."""
    want = models["off"].generate(PROMPT, max_tokens=40, logprobs=3, **kw)
    got = models[spec].generate(PROMPT, max_tokens=40, logprobs=3, **kw)
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert max(models[spec].last_decoder.stats.accepted) > 0  # some event emitted several tokens


def test_logprobs_are_cut_with_the_tokens(models):
    llm = models["tree"]
    full = llm.generate(PROMPT, max_tokens=30, temperature=0, logprobs=1)
    stop = llm.tokenizer.decode(full.token_ids[5:7])
    cut = llm.generate(PROMPT, max_tokens=30, temperature=0, logprobs=1, stop=stop)
    assert cut.finish_reason == "stop" and len(cut.logprobs) == len(cut.token_ids) < len(full.token_ids)
    assert cut.logprobs == full.logprobs[: len(cut.token_ids)]
    short = llm.generate(PROMPT, max_tokens=3, temperature=0, logprobs=1)
    assert short.logprobs == full.logprobs[:3]
    chunks = list(llm.generate_stream(PROMPT, max_tokens=30, temperature=0, logprobs=1))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [t for c in chunks for t in c.logprobs] == full.logprobs
    assert llm.generate(PROMPT, max_tokens=4).logprobs is None  # off unless asked


def test_prefix_cache_hit_gives_the_same_logprobs(tmp_path):
    path = embedded_or_skip()
    cold = LLM(path, device="cpu", spec="tree", prefix_snapshots=0)
    warm = LLM(path, device="cpu", spec="tree", prefix_snapshots=4)
    ids = torch.randint(0, 3000, (1100,), generator=torch.Generator().manual_seed(1)).tolist()
    warm.generate(ids[:1000], max_tokens=2)
    got = warm.generate(ids, max_tokens=16, temperature=0, logprobs=2)
    assert got.cached_tokens > 0
    assert got.logprobs == cold.generate(ids, max_tokens=16, temperature=0, logprobs=2).logprobs


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0, "3"])
def test_bad_logprobs_are_value_errors(models, bad):
    with pytest.raises(ValueError, match="logprobs must be None or an integer"):
        models["off"].generate(PROMPT, max_tokens=2, logprobs=bad)


def test_token_bytes_spell_the_text():
    tok = Tokenizer.from_dir(embedded_or_skip())
    text = "héllo wörld 😀 <|im_end|> naïve 東京"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    pieces = [tok.token_text(i) for i in ids]
    assert "\ufffd" in pieces and "<|im_end|>" in pieces  # a split character; an added token whole


def test_byte_level_alphabet_is_the_tokenizers_one():
    from tokenizers import pre_tokenizers

    table = _byte_level_alphabet()
    assert sorted(table) == list(range(256))
    assert sorted(table.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a" and table[ord("a")] == "a"


def test_token_logprob_is_a_value():
    a = TokenLogprob(3, -0.5, [(3, -0.5)])
    assert a == TokenLogprob(3, -0.5, [(3, -0.5)]) and a != TokenLogprob(3, -0.5)


@pytest.mark.parametrize("spec", ["off", "tree"])
def test_the_end_of_sequence_token_keeps_its_logprob(models, spec, monkeypatch):
    """An output ended by an end-of-sequence token (here: made one, the greedy output's 6th token) leaves
    it out of token_ids and the text but reports its logprob (`eos_logprob`, on the last chunk), the one
    plain decoding computed; within an event too."""
    llm = models[spec]
    full = llm.generate(PROMPT, max_tokens=24, temperature=0, logprobs=2)
    j = full.token_ids.index(full.token_ids[5])  # its first occurrence
    monkeypatch.setattr(llm.tokenizer, "eos_token_ids", (full.token_ids[j],))
    r = llm.generate(PROMPT, max_tokens=24, temperature=0, logprobs=2)
    assert r.finish_reason == "stop" and r.token_ids == full.token_ids[:j]
    assert r.logprobs == full.logprobs[:j] and r.eos_logprob == full.logprobs[j]
    chunks = list(llm.generate_stream(PROMPT, max_tokens=24, temperature=0, logprobs=2))
    assert [c.eos_logprob for c in chunks] == [None] * (len(chunks) - 1) + [full.logprobs[j]]
    assert llm.generate(PROMPT, max_tokens=24, temperature=0).eos_logprob is None  # not asked


def test_http_logprobs_end_of_sequence_offsets_and_ties(models, monkeypatch):
    """Through the HTTP app (in process): the end-of-sequence entry closes the completions lists (its text
    not in the response), echo's text_offset points at each token's text in the response text (non-ASCII
    prompt), and a top_logprobs text shared by two tokens keeps the more likely one's value."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lumo.server.app import create_app

    llm = models["off"]
    tok = llm.tokenizer
    prompt = "naïve café: 東京 😀 def f(x):\n    return"
    full = llm.generate(prompt, max_tokens=8, temperature=0, logprobs=1)
    eos = full.token_ids[2]
    monkeypatch.setattr(tok, "eos_token_ids", (eos,))
    j = full.token_ids.index(eos)
    with TestClient(create_app(llm)) as client:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 3}
        r = client.post("/v1/completions", json=body).json()
        choice = r["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
        n = len(tok.encode(prompt))
        assert choice["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == j + 1
        assert lp["tokens"][-1] == tok.token_text(eos)
        assert lp["token_logprobs"][-1] == full.logprobs[j].logprob
        assert len(lp["tokens"]) == n + j + 1 and text == prompt + full.text[: len(text) - len(prompt)]
        whole = [k for k, s in enumerate(lp["tokens"][:-1]) if "\ufffd" not in s]
        assert len(whole) >= 10  # the tiny vocabulary splits most non-ASCII characters
        for k in whole:
            s, off = lp["tokens"][k], lp["text_offset"][k]
            assert text[off : off + len(s)] == s, (k, s, off)
        events = client.post("/v1/completions", json={**body, "stream": True}).iter_lines()
        chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        streamed = [x for c in chunks if c["choices"] for x in c["choices"][0]["logprobs"]["text_offset"]]
        assert streamed == lp["text_offset"]
    # ties: the top list's texts collide on U+FFFD (partial UTF-8 tokens); the better value is kept
    from lumo.engine.logprobs import TokenLogprob
    from lumo.server.logprobs import completion_logprobs

    partial = [i for i in range(tok.vocab_size) if tok.token_text(i) == "\ufffd"][:2]
    t = TokenLogprob(partial[0], -1.0, [(partial[0], -1.0), (partial[1], -2.0)])
    assert completion_logprobs(tok, [partial[0]], [t], [0])["top_logprobs"] == [{"\ufffd": -1.0}]
