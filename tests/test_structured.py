"""Structured outputs (lumo.engine.grammar) on the CPU: the specification's checks, the grammar state over
a tree against each path walked alone, speculative == plain decoding bit for bit under a grammar, and
`LLM.generate(structured_outputs=...)` on the embedded model."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

from lumo import LLM
from lumo.config import TreeConfig
from lumo.engine.decode import PlainDecoder, SpecDecoder
from lumo.engine.grammar import (
    ANSWER,
    MAY_THINK,
    THINKING,
    Constraint,
    GrammarCompiler,
    GrammarError,
    StructuredOutputs,
    bitmask_words,
    reasoning_start,
    unpack_bitmask,
)
from lumo.engine.llm import embedded_model_path
from lumo.engine.sampling import SamplingParams
from lumo.tokenizer import Tokenizer
from lumo.weights import load_model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutputs(json=PERSON),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,5}"),
    "choice": StructuredOutputs(choice=["yes", "no", "maybe not"]),
    "grammar": StructuredOutputs(grammar='start: "def " NAME "(" ")"\nNAME: /[a-z_]+/'),
}


@functools.cache
def tok() -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_path())


@functools.cache
def compiler() -> GrammarCompiler:
    t = tok()
    return GrammarCompiler(
        t.to_json(), 3072, t.eos_token_ids, think=(t.token_to_id("<think>"), t.token_to_id("</think>"))
    )


@functools.cache
def llm() -> LLM:
    return LLM(device="cpu")


# ---- the specification ----


@pytest.mark.parametrize(
    "value,msg",
    [
        ({}, "exactly one of"),
        ({"json": PERSON, "regex": "a"}, "json and regex"),
        ({"jsn": PERSON}, "unknown field"),
        ("a", "must be a mapping"),
        ({"json_object": "yes"}, "true or false"),
    ],
)
def test_specification_needs_exactly_one_form(value, msg):
    with pytest.raises(ValueError, match=msg):
        StructuredOutputs.of(value)


@pytest.mark.parametrize(
    "spec,msg",
    [
        (StructuredOutputs(json="{not json"), "not JSON"),
        (StructuredOutputs(json=[1]), "is an object"),
        (StructuredOutputs(json={"type": "nope"}), "invalid structured output"),
        (StructuredOutputs(regex="[0-9"), "invalid structured output"),
        (StructuredOutputs(choice=[]), "non-empty list"),
        (StructuredOutputs(choice="yes"), "non-empty list"),
        (StructuredOutputs(grammar="start: ("), "invalid structured output"),
    ],
)
def test_bad_grammars_are_one_line_value_errors(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        compiler().constraint(spec)
    assert "\n" not in str(e.value)


def test_reasoning_start():
    o, c = 1, 2
    assert reasoning_start([5, o, 7], o, c) == THINKING and reasoning_start([o, c, 3, o], o, c) == THINKING
    assert reasoning_start([5, o, 7, c, 9], o, c) == ANSWER  # a closed block: thinking off
    assert reasoning_start([5, 6], o, c) == MAY_THINK  # no tags: the model may open one itself
    assert reasoning_start([o], o, None) == ANSWER  # no such tokens
    # only the last turn counts (after the last end token): a user's text that spells the tags does not
    end = 9
    assert reasoning_start([5, o, 7, end, 4], o, c, [end]) == MAY_THINK
    assert reasoning_start([o, c, end, 4, o], o, c, [end]) == THINKING
    assert reasoning_start([5, o, end, 4, o, c], o, c, [end]) == ANSWER
    assert reasoning_start([5, o, end], o, c, [end]) == MAY_THINK


# ---- the grammar state ----


def test_mask_follows_the_grammar():
    """The choice grammar allows exactly the tokens that begin a choice, then only what continues it,
    then only the end tokens (both of the model's)."""
    con = compiler().constraint(SPECS["choice"])
    first = con.allowed()
    for word in ("yes", "no", "maybe not"):
        assert first[tok().encode(word)[0]]
    assert not first[tok().encode("x")[0]]
    con.advance(tok().encode("yes"))
    end = con.allowed()
    assert set(torch.nonzero(end).flatten().tolist()) == set(tok().eos_token_ids)
    with pytest.raises(RuntimeError, match="refuses"):
        con.advance(tok().encode("x"))


def test_special_tokens_the_matcher_would_not_take_are_masked_out():
    """llguidance's mask allows a special token whose text a lexeme matches (`<tool_call>` spelt in a
    regular expression), which its matcher refuses to consume: lumo clears such bits, so that what the mask
    allows, advance takes; a grammar left with nothing is a GrammarError (a ValueError: the request's)."""
    import llguidance as llg

    c = compiler()
    grammar = StructuredOutputs(regex="<tool_call>y").llguidance()  # llguidance's mask: the special token
    m = llg.LLMatcher(c.tokenizer, grammar, log_level=0)
    row = torch.zeros(bitmask_words(c.vocab_size), dtype=torch.int32)
    m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
    assert m.deep_copy().validate_tokens([3070]) == 0 and not m.is_error()
    assert unpack_bitmask(row, c.vocab_size)[3070]  # what llguidance's mask says
    con = Constraint(m, c.vocab_size, c.end_ids, c.think, MAY_THINK, c.special)
    assert con._mask(m, row) == 1 and not unpack_bitmask(row, c.vocab_size).any()  # lumo's: nothing left
    with pytest.raises(GrammarError, match="no token"):
        con.allowed()
    with pytest.raises(ValueError, match="no token"):  # so it is a 400 before generating
        c.constraint(StructuredOutputs(regex="<tool_call>y"))
    with pytest.raises(GrammarError, match="no token"):
        con = compiler().constraint(StructuredOutputs(json={"$ref": "#"}))
        for _ in range(50):
            con.advance([int(torch.nonzero(con.allowed()).flatten()[0])])


def test_json_regex_and_choice_masks_drop_special_tokens_without_asking():
    """JSON schemas, regular expressions and choices never name a special token, so their masks drop every
    special bit (no matcher call per token): the same masks as asking the matcher, state by state, and the
    same GrammarError where llguidance's mask allows only a special token (a regular expression that spells
    one, which its matcher takes only as text it cannot consume); a Lark grammar that names one keeps it."""
    c = compiler()
    specials = sorted({t for _, _, ids in c.special for t in ids})
    for spec, text in (
        (StructuredOutputs(json={"type": "array", "items": {"type": "string"}}), '["a <b> c","d"]'),
        (StructuredOutputs(regex="[a-z<>_/ ]+"), "ab <c> d"),
        (StructuredOutputs(choice=["<x>", "b"]), "<x>"),
        (StructuredOutputs(regex="ab<think>x"), "ab"),
    ):
        con = c.constraint(spec, c.think)  # a closed think block: the grammar from the first token
        assert not con.check_special
        asked = c.constraint(spec, c.think)
        asked.check_special = True
        for t in tok().encode(text):
            fast, slow = con.allowed(), asked.allowed()
            assert torch.equal(fast, slow) and not fast[specials].any()
            con.advance([t])
            asked.advance([t])
    raw = torch.zeros(bitmask_words(c.vocab_size), dtype=torch.int32)
    con.matcher.unsafe_compute_mask_ptr(raw.data_ptr(), raw.numel() * 4)
    assert unpack_bitmask(raw, c.vocab_size)[3068]  # llguidance's mask: <think>, only
    for each in (con, asked):
        with pytest.raises(GrammarError, match="no token"):
            each.allowed()
    named = c.constraint(StructuredOutputs(grammar='start: <[3070]> "y"'), c.think)
    assert named.check_special and named.allowed()[3070]


def test_a_long_choice_is_one_expression():
    """3000 choices (llguidance's parser takes 2000 items in a row; a regular expression any number), with
    the characters a regular expression treats specially."""
    choices = [f"o{i}" for i in range(3000)] + ["a/b", "x\ny", "(1+2)*3?", "[k]{2}", "#~&-^$|", "back\\slash"]
    for text in ("o2999", "a/b", "x\ny", "(1+2)*3?", "[k]{2}", "#~&-^$|", "back\\slash"):
        con = compiler().constraint(StructuredOutputs(choice=choices))
        con.advance(tok().encode(text))
        assert con.matcher.is_accepting(), text
    con = compiler().constraint(StructuredOutputs(choice=choices))
    with pytest.raises(RuntimeError):
        con.advance(tok().encode("(1+2)*3!"))


def test_bitmask_rows_are_checked():
    """llguidance writes a mask through a raw pointer: a row too short, of another dtype or not contiguous
    is a ValueError, never a write past it."""
    con = compiler().constraint(SPECS["choice"])
    for row in (
        torch.zeros(con.words - 1, dtype=torch.int32),
        torch.zeros(con.words, dtype=torch.int64),
        torch.zeros(2 * con.words, dtype=torch.int32)[::2],
    ):
        with pytest.raises(ValueError, match="bitmask row"):
            con.bitmask(out=row)
    assert con.bitmask(out=torch.zeros(con.words + 1, dtype=torch.int32)) is not None


def test_json_may_start_after_two_blanks():
    """JSON has no whitespace between its tokens, but up to two spaces or newlines may come first (a
    thinking model's "\n\n" after `</think>`), not three (a small model would pad forever)."""
    for text, ok in (('{"name":"A","age":1}', True), ('\n\n{"name":"A","age":1}', True),
                     ('\n\n\n{"name":"A","age":1}', False), ('{"name": "A","age":1}', False)):  # fmt: skip
        con = compiler().constraint(SPECS["json"])
        try:
            con.advance(tok().encode(text))
            assert ok and con.matcher.is_accepting(), text
        except RuntimeError:
            assert not ok, text


def _random_tree(gen: torch.Generator, n: int, pool: list[int]) -> tuple[list[int], list[int]]:
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = [pool[int(torch.randint(0, len(pool), (1,), generator=gen))] for _ in range(n)]
    return tokens, parent


# Lark lexemes with max_tokens= / stop=: llguidance cannot roll their matcher back (tree walks copy it)
NO_ROLLBACK = StructuredOutputs(grammar='start: "x" word ":" NUM\nword[stop=" "]: /[a-z ]+/\nNUM: /[0-9]+/')
CAPPED = StructuredOutputs(grammar='start: "x" word\nword[max_tokens=4]: /[a-z0-9 ]+/')


@pytest.mark.parametrize(
    "spec,committed,text,start",
    [
        (SPECS["json"], '{"name":"A', '{"name":"Ann","age":42} x', ANSWER),
        (SPECS["json"], "hmm", '{"name":"Ann","age":42} x', THINKING),
        (SPECS["json"], "", '{"name":"Ann","age":42} x', MAY_THINK),
        (NO_ROLLBACK, "x", "ab cd :12 x", ANSWER),
        (CAPPED, "x", "ab cd 12 z", ANSWER),
    ],
    ids=["json", "json-after-reasoning", "json-may-think", "lark-stop", "lark-max-tokens"],
)
def test_tree_bitmasks_equal_each_path_walked_alone(spec, committed, text, start):
    """Every live row's mask is the mask a fresh constraint has after the committed tokens and that row's
    path; rows below a refused token (or still reasoning) are unmasked; the request's matcher is left as
    it was. Random trees over the tokens of a text, end and think tokens among them; also grammars whose
    matcher cannot roll back."""
    t = tok()
    committed = t.encode(committed) if committed else []
    think = t.token_to_id("<think>"), t.token_to_id("</think>")
    prompt = {ANSWER: [*think], THINKING: [think[0]], MAY_THINK: []}[start]
    pool = sorted({*t.encode(text), *think, *t.eos_token_ids})
    gen = torch.Generator().manual_seed(0)
    live_rows, copied = 0, False
    for _ in range(40):
        con = compiler().constraint(spec, prompt)
        con.advance(committed)
        before = con.bitmask()
        tokens, parent = _random_tree(gen, 24, pool)
        bits = torch.zeros(24, con.words, dtype=torch.int32)
        on = con.tree_bitmasks(tokens, parent, bits)
        assert before is None or torch.equal(con.bitmask(), before)  # the matcher is back where it was
        for i in range(24):
            path, j = [], i
            while j > 0:
                path.append(tokens[j])
                j = parent[j]
            alone = compiler().constraint(spec, prompt)
            alone.advance(committed)
            try:
                alone.advance(path[::-1])
            except RuntimeError:  # a refused token on the path: the row is never reached
                assert not on[i]
                continue
            want = alone.bitmask()
            assert on[i] == (want is not None), i
            if want is not None:
                assert torch.equal(bits[i], want), i
                live_rows += 1
        copied = copied or con.walk_with_copies
    assert live_rows > 40  # the trees reach deep enough into the grammar to test something
    assert copied == (spec is NO_ROLLBACK or spec is CAPPED)  # the walk fell back to copies for those


def test_end_tokens_leave_the_state_alone():
    """An end token (allowed where the grammar may end) does not move the grammar: a request that goes on
    after it (ignore_eos) is masked as before it, in a tree and in plain decoding alike."""
    con = compiler().constraint(SPECS["regex"])
    con.advance(tok().encode("123-ab"))
    before = con.bitmask()
    eos = tok().eos_token_ids[0]
    assert unpack_bitmask(before, 3072)[eos]
    con.advance([eos])
    assert torch.equal(con.bitmask(), before)


# ---- decoding under a grammar: speculative == plain ----


@functools.cache
def embedded32():
    return load_model(embedded_model_path(), device="cpu", dtype=torch.float32, progress=False)


def _decode(decoder, spec: StructuredOutputs, prompt: list[int], n: int) -> tuple[list[int], list]:
    """Tokens (to the first end token, or n or a few more) and their logprobs if the decoder gives any."""
    decoder.constraint = compiler().constraint(spec)
    out = decoder.prefill(prompt)
    lps = list(decoder.last_logprobs)
    while len(out) < n and not set(out) & set(tok().eos_token_ids):
        out += decoder.step()
        lps += decoder.last_logprobs
    return out, lps


@pytest.mark.parametrize("form", ["json", "regex", "grammar", "lark-stop"])
@pytest.mark.parametrize(
    "tree",
    [TreeConfig(depth=5, topk=3, budget=12, rows=16), TreeConfig(depth=4, topk=1, budget=4, rows=8)],
    ids=["tree", "chain"],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_speculative_equals_plain_under_a_grammar(form, tree, temperature):
    """Tree and chain speculation emit plain decoding's tokens under each grammar, with its logprobs
    (the masked rows'), and the text follows the grammar."""
    cfg, w = embedded32()
    params = SamplingParams(temperature=temperature, top_k=40, seed=11)
    prompt = tok().encode("Here is the record:\n")
    plain = PlainDecoder(cfg, w, params, 160, "cpu", torch.float32)
    spec = SpecDecoder(cfg, w, params, 160, "cpu", torch.float32, tree)
    plain.logprobs = spec.logprobs = 2
    so = NO_ROLLBACK if form == "lark-stop" else SPECS[form]
    got, got_lp = _decode(spec, so, prompt, 48)
    want, want_lp = _decode(plain, so, prompt, len(got))
    assert got[: len(want)] == want and got_lp[: len(want)] == want_lp
    assert spec.stats.events > 0 and sum(spec.stats.accepted) > 0  # drafts accepted under the grammar
    text = tok().decode([t for t in want if t not in tok().eos_token_ids])
    if set(want) & set(tok().eos_token_ids):  # the grammar ended the output: it matches it whole
        if form == "json":
            assert set(json.loads(text)) == {"name", "age"}
        elif form == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text)
        elif form == "grammar":
            assert re.fullmatch(r"def [a-z_]+\(\)", text)


def test_drafter_proposes_under_the_grammar(monkeypatch):
    """The reference drafter's spine under the grammar (Constraint.spine): the same tokens as an
    unconstrained drafter's, many more drafts accepted under a JSON schema."""
    from lumo.engine.grammar import Constraint

    cfg, w = embedded32()
    lines = {"type": "array", "items": {"type": "string"}, "minItems": 200}
    so = StructuredOutputs(json={"type": "object", "properties": {"lines": lines}, "required": ["lines"]})
    prompt = tok().encode("Here is the record:\n")
    runs = []
    for masked in (True, False):
        if not masked:
            monkeypatch.setattr(Constraint, "spine", lambda self: None)
        spec = SpecDecoder(cfg, w, SamplingParams(temperature=0.0), 160, "cpu", torch.float32, TreeConfig())
        out, _ = _decode(spec, so, prompt, 64)
        runs.append((out[:64], spec.stats.mean_accepted))
    (masked_out, masked_rate), (free_out, free_rate) = runs
    assert masked_out == free_out and masked_rate > 1.5 * free_rate, runs


def test_tree_rows_are_masked_with_their_paths():
    """A mutant masking every row with the root's state (not its path's) parts from plain decoding: the
    test above would catch it."""
    cfg, w = embedded32()
    params = SamplingParams(temperature=0.0)
    prompt = tok().encode("Here is the record:\n")
    plain = PlainDecoder(cfg, w, params, 160, "cpu", torch.float32)
    want, _ = _decode(plain, SPECS["json"], prompt, 40)
    spec = SpecDecoder(
        cfg, w, params, 160, "cpu", torch.float32, TreeConfig(depth=5, topk=3, budget=12, rows=16)
    )
    spec.constraint = compiler().constraint(SPECS["json"])
    real = spec.constraint.tree_bitmasks

    def root_only(tokens, parent, out):
        on = real(tokens, parent, out)
        out[1:] = out[0]
        return on

    spec.constraint.tree_bitmasks = root_only
    got = spec.prefill(prompt)
    try:
        while len(got) < len(want):
            got += spec.step()
    except RuntimeError as e:  # it emitted a token the grammar refuses
        assert "refuses" in str(e)
        return
    assert got[: len(want)] != want


# ---- LLM ----


def test_llm_generates_json_of_the_schema():
    r = llm().generate("A person:", max_tokens=80, temperature=0, structured_outputs={"json": PERSON})
    assert r.finish_reason == "stop"
    assert set(json.loads(r.text)) == {"name", "age"}


def test_llm_choice_and_regex():
    r = llm().generate(
        "Answer:", max_tokens=10, temperature=0.9, seed=3, structured_outputs={"choice": ["yes", "no"]}
    )
    assert r.text in ("yes", "no") and r.finish_reason == "stop"
    r = llm().generate(
        "Code:", max_tokens=20, structured_outputs=StructuredOutputs(regex=r"[A-Z]{2}[0-9]{2}")
    )
    assert re.fullmatch(r"[A-Z]{2}[0-9]{2}", r.text)


def test_llm_grammar_starts_after_the_reasoning():
    """A prompt ending in `<think>`: the reasoning is free text (here cut short by a bias on `</think>`,
    which the grammar's mask then keeps out), the answer after it follows the grammar."""
    t = tok()
    close = t.token_to_id("</think>")
    prompt = t.encode("Question: yes or no?\n") + [t.token_to_id("<think>")]
    bias = {close: 100.0}
    r = llm().generate(
        prompt, max_tokens=12, temperature=0, logit_bias=bias, structured_outputs={"choice": ["yes", "no"]}
    )
    assert r.token_ids[0] == close
    assert t.decode(r.token_ids[1:]) in ("yes", "no") and r.finish_reason == "stop"
    # a prompt with no think tags: the first token may also be `<think>` (lifted here: the model thinks,
    # then answers by the grammar); one with a closed block: the grammar from the first token, `<think>`
    # refused however lifted
    opening = t.token_to_id("<think>")
    lift = {opening: 99.5, close: 100.0}  # the first token <think> (close refused there), then </think>
    r = llm().generate(
        "Question:",
        max_tokens=12,
        temperature=0,
        logit_bias=lift,
        structured_outputs={"choice": ["yes", "no"]},
    )
    assert r.token_ids[:2] == [opening, close] and t.decode(r.token_ids[2:]) in ("yes", "no")
    closed = t.encode("Question:") + [opening, close]
    r = llm().generate(
        closed, max_tokens=12, temperature=0, logit_bias=lift, structured_outputs={"choice": ["yes", "no"]}
    )
    assert not {opening, close} & set(r.token_ids) and r.text in ("yes", "no")


def test_logprobs_under_a_grammar_list_allowed_alternatives_only():
    """The masked row's logprobs: alternatives at -inf (refused) are left out, so a choice of two words
    lists at most the tokens that can begin them, each with a finite logprob."""
    r = llm().generate(
        "Answer:", max_tokens=4, temperature=0, logprobs=5, structured_outputs={"choice": ["yes", "no"]}
    )
    allowed = llm().constraint(StructuredOutputs(choice=["yes", "no"]), r.prompt_token_ids).allowed()
    first = r.logprobs[0]
    assert 0 < len(first.top) < 5 and all(allowed[i] and v > -1e30 for i, v in first.top)


def test_llm_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="min_tokens"):
        llm().generate("x", max_tokens=8, min_tokens=2, structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="invalid structured output"):
        llm().generate("x", max_tokens=8, structured_outputs={"regex": "(("})


def test_a_spine_where_the_grammar_fails_does_not_fail_the_request():
    """A drafted spine can reach a state where the grammar allows nothing (here only a special token it
    would refuse): the drafter stops masking there (allowed_or_none: None), while plain decoding, which
    never takes that spine, is unaffected; the state itself still fails for whoever samples there."""
    con = compiler().constraint(StructuredOutputs(regex="x<tool_call>y|zz"), [3067, *tok().encode("Q")])
    assert con.draft_bitmask() is not None
    spine = con.spine()
    spine.advance(tok().encode("x"))
    assert spine.draft_bitmask() is None
    with pytest.raises(GrammarError, match="no token"):
        spine.allowed()
    con.advance(tok().encode("zz"))  # the request's own state: fine
    assert con.matcher.is_accepting()
