from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from lumo.testing import make_tokenizer_files
from lumo.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError, read_chat_template

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Ünïcödé café naïve Straße ½ €",
    "Emoji 😀🎉 🚀 👍🏽 family 👨‍👩‍👧 ❤️!",
    "日本語のテキスト。中文文本测试。한국어",
    "mixed: a😀b日c\u00e9d\n\ttabs and  spaces  ",
]
POOL = list("abc xyz.,!\n") + list("éßü€日本語中文한😀🎉👍🏽\u200d")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def stream(
    tok: Tokenizer, ids: list[int], stop: list[str] | None = None
) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, stop=stop)
    chunks = []
    for i in ids:
        chunks.append(det.add(i))
        if det.stopped:
            break
    chunks.append(det.finish())
    return chunks, det


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(POOL) for _ in range(n))


# ---- ids -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_encode_matches_the_library_and_refuses_lone_surrogates(tok):
    rng = random.Random(3)
    for text in [*TEXTS, *(random_text(rng, 200) for _ in range(20))]:
        assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids
    with pytest.raises(TokenizerError, match="lone surrogate U[+]D800 at character 1"):
        tok.encode("a\ud800b")
    assert tok.max_token_chars >= max(len(tok.decode([i])) for i in range(tok.vocab_size))


def test_encode_lets_other_threads_run(tok):
    """A long prompt tokenised in a server worker thread must not hold the GIL (it stalled the event loop:
    the library's encode holds it, encode_batch does not)."""
    import threading
    import time

    text = "abc def " * 200_000
    done, ticks = threading.Event(), 0
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    t0 = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.005)
        ticks += 1
    worker.join()
    elapsed = time.perf_counter() - t0
    assert elapsed > 0.2, "the text tokenised too fast to tell"
    assert ticks > 0.3 * elapsed / 0.005, (ticks, elapsed)  # holding the GIL gave ~2 ticks in 1.7 s


def test_no_bos_and_special_tokens(tok):
    assert tok.encode("a") == [tok.token_to_id("a")]  # nothing prepended
    ids = tok.encode("<|im_start|>user\nhi<think>x</think><|im_end|>")
    for s in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tok.token_to_id(s) in ids  # added tokens are matched whole, not split into bytes
    # ChatML markers are special (dropped on request); <think> is not, so reasoning parsers still see it
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"


# ---- incremental detokenizer -----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS[1:] + ["😀" * 7, "日本語" * 5])
def test_detok_never_emits_broken_utf8(tok, text):
    ids = tok.encode(text)
    # the test only means something if some token ends inside a character
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
    chunks, det = stream(tok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == det.text == tok.decode(ids)


def test_detok_random_streams(tok):
    rng = random.Random(1234)
    for _ in range(40):
        text = random_text(rng, rng.randint(1, 40))
        ids = tok.encode(text)
        chunks, det = stream(tok, ids)
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == text


def test_detok_skips_special_tokens(tok):
    ids = tok.encode("<think>\nhm\n</think>\n\nA日😀<|im_end|>")
    chunks, _ = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nA日😀"


def test_detok_decodes_a_window_only(tok):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(random_text(random.Random(7), 400))
    det = IncrementalDetokenizer(Counting(), stop=["never-appears"])  # type: ignore[arg-type]
    out = "".join(det.add(i) for i in ids) + det.finish()
    assert out == tok.decode(ids)
    assert len(ids) > 300 and max(calls) <= 8  # a window of recent tokens, not the whole sequence


def reference_stop(text: str, stops: list[str]) -> str | None:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(hits)] if hits else None


def reference_stream_stop(tok: Tokenizer, ids: list[int], stops: list[str]) -> str | None:
    # Generation ends at the first token after which the text holds a stop string; the output is cut at the
    # earliest stop in that text (a stop that completes first wins over one that would start earlier).
    for k in range(1, len(ids) + 1):
        if (cut := reference_stop(tok.decode(ids[:k]), stops)) is not None:
            return cut
    return None


@pytest.mark.parametrize(
    "text,stops",
    [
        ("Hello world. The END is here", ["END"]),
        ("Hello world. The END is here", ["world. The E", "The"]),  # the stop completed first wins
        ("xxabcdyy", ["abcd", "bc"]),  # one stop inside another: the earliest start wins
        ("a 日本語 b", ["本語 b", "本語"]),  # one stop a prefix of another, multi-byte, spanning tokens
        ("price: 5€ 😀 done", ["€ 😀"]),
        ("THE END.", ["ENDING", "ENDS"]),  # a partial match that never completes is emitted in the end
    ],
)
def test_stop_strings(tok, text, stops):
    ids = tok.encode(text)
    chunks, det = stream(tok, ids, stops)
    expected = reference_stream_stop(tok, ids, stops)
    if expected is None:
        assert not det.stopped and "".join(chunks) == text
        return
    assert det.stopped and "".join(chunks) == det.text == expected
    # it stopped on the very token that completed the stop string, not later
    used = next(k for k in range(1, len(ids) + 1) if reference_stop(tok.decode(ids[:k]), stops) is not None)
    det2 = IncrementalDetokenizer(tok, stop=stops)
    for k, i in enumerate(ids[:used], 1):
        det2.add(i)
        assert det2.stopped == (k == used)
    assert det2.add(ids[0]) == "" and det2.finish() == ""  # nothing after a stop


def test_stop_held_back_until_resolved(tok):
    ids = tok.encode("ab END")
    det = IncrementalDetokenizer(tok, stop=["ENDX"])
    emitted = ""
    for i in ids:
        emitted += det.add(i)
        # whatever was emitted so far cannot contain the start of a possible stop
        assert not any("ENDX".startswith(emitted[j:]) for j in range(len(emitted)))
    assert emitted == "ab " and det.finish() == "END" and det.text == "ab END"


def test_stop_at_first_token(tok):
    ids = tok.encode("Hello")
    first = tok.decode(ids[:1])
    det = IncrementalDetokenizer(tok, stop=[first])
    assert det.add(ids[0]) == "" and det.stopped and det.text == ""


def test_no_stop(tok):
    text = TEXTS[2]
    for stops in (None, [], ["zzz"]):
        chunks, det = stream(tok, tok.encode(text), stops)
        assert not det.stopped and "".join(chunks) == text


def test_stop_random(tok):
    rng = random.Random(99)
    for _ in range(60):
        text = random_text(rng, rng.randint(2, 30))
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 6)] if rng.random() < 0.7 else random_text(rng, 3))
        ids = tok.encode(text)
        chunks, det = stream(tok, ids, stops)
        expected = reference_stream_stop(tok, ids, stops)
        assert det.stopped == (expected is not None)
        assert "".join(chunks) == (text if expected is None else expected)
        assert all("\ufffd" not in c for c in chunks)


# ---- chat template ---------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for <city> & region",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_chat_basic(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]},
    ]
    with_prompt = tok.apply_chat_template(msgs)
    without = tok.apply_chat_template(msgs, add_generation_prompt=False)
    turns = without.split("<|im_end|>\n")
    assert turns == [
        "<|im_start|>system\nBe brief.",
        "<|im_start|>user\nHi",
        "<|im_start|>assistant\nHello!",
        "<|im_start|>user\nHow are you?",
        "",
    ]
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # extra kwargs reach the template
    assert tok.apply_chat_template(msgs, enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(msgs, enable_thinking=True) == with_prompt


def test_chat_continue_final_message(tok):
    """continue_final_message (a prefilled reply): the text ends where the last message's content does,
    however the template wraps it (whitespace it strips too); exclusive with add_generation_prompt."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here is"}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, here is"
    for content in ("  Sure, here is \n", "", "\n", "<think>\nhmm"):  # as given, whitespace and all
        m = [msgs[0], {"role": "assistant", "content": content}]
        want = out.replace("Sure, here is", content)
        assert tok.apply_chat_template(m, add_generation_prompt=False, continue_final_message=True) == want
    with pytest.raises(TokenizerError, match="exclude each other"):
        tok.apply_chat_template(msgs, continue_final_message=True)
    with pytest.raises(TokenizerError, match="text content"):
        tok.apply_chat_template(
            msgs[:1] + [{"role": "assistant", "content": None}],
            add_generation_prompt=False,
            continue_final_message=True,
        )


def test_chat_tools_and_results(tok):
    msgs = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "18C"},
        {"role": "tool", "tool_call_id": "2", "content": "3C"},
    ]
    out = tok.apply_chat_template(msgs, tools=[WEATHER_TOOL])
    system, rest = out.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n")
    tools_block = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in tools_block.splitlines()] == [WEATHER_TOOL]
    assert "<city> & region" in tools_block  # tojson must not HTML-escape
    calls = [json.loads(c.split("\n</tool_call>")[0]) for c in rest.split("<tool_call>\n")[1:]]
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
    ]
    # consecutive tool results share one user turn
    tail = "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n3C\n</tool_response>"
    assert out.endswith(tail + "<|im_end|>\n<|im_start|>assistant\n")
    # a system message and tools share the system turn
    out2 = tok.apply_chat_template([{"role": "system", "content": "SYS"}, *msgs[:1]], tools=[WEATHER_TOOL])
    assert out2.startswith("<|im_start|>system\nSYS\n\n") and out2.count("<|im_start|>system") == 1


def test_chat_template_errors(tok):
    with pytest.raises(TokenizerError, match="system message may only come first"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def copy_tok(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text()) if path.exists() else {}
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


def test_template_from_jinja_file(tok_dir, tmp_path):
    d = copy_tok(tok_dir, tmp_path / "t")
    # trim_blocks/lstrip_blocks like transformers, loopcontrols, tojson and the special-token strings
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}|{{ eos_token }}|\n"
        "{% for m in messages %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "[{{ m.role }}:{{ m.content | tojson }}]\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}GO{% endif %}"
    )
    edit_json(d / "tokenizer_config.json", bos_token="<|endoftext|>")
    t = Tokenizer.from_dir(d)
    msgs = [
        {"role": "user", "content": "<a&b>"},
        {"role": "assistant", "content": "é"},
        {"role": "user", "content": "x"},
    ]
    assert t.apply_chat_template(msgs) == '<|endoftext|>|<|im_end|>|\n[user:"<a&b>"]\n[assistant:"é"]\nGO'
    assert t.apply_chat_template(msgs, add_generation_prompt=False).endswith('"é"]\n')


def test_template_list_form(tok_dir, tmp_path):
    d = copy_tok(tok_dir, tmp_path / "t")
    templates = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T"},
    ]
    edit_json(d / "tokenizer_config.json", chat_template=templates)
    t = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "x"}]
    assert t.has_chat_template
    assert t.apply_chat_template(msgs) == "D1"
    assert t.apply_chat_template(msgs, tools=[WEATHER_TOOL]) == "T"


def test_chat_template_override(tok_dir, tmp_path):
    """--chat-template / LLM(chat_template=): a file or the text itself, checked at once, used for every
    chat in place of the checkpoint's templates (a tool_use one included)."""
    d = copy_tok(tok_dir, tmp_path / "t")
    edit_json(
        d / "tokenizer_config.json",
        chat_template=[{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}],
    )
    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ '!' if tools else '' }}"
    (tmp_path / "mine.jinja").write_text(source, encoding="utf-8")
    for given in (tmp_path / "mine.jinja", str(tmp_path / "mine.jinja"), source):
        assert read_chat_template(given) == source
    t = Tokenizer.from_dir(d)
    t.apply_chat_template([{"role": "user", "content": "x"}])  # the checkpoint's, compiled and cached
    t.set_chat_template(read_chat_template(source))
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x"
    assert t.apply_chat_template([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL]) == "<user>x!"
    assert t.chat_template_source(tools=True) == source
    for bad, words in (
        (tmp_path / "none.jinja", "no such file"),
        ("chatml", "no such file, and not a jinja template"),
        ("{% for %}", "does not compile"),
        ("x" * 5000 + "{{", "does not compile"),  # too long for a path: taken as a template
        (tmp_path, "no such file"),  # a directory
    ):
        with pytest.raises(TokenizerError, match=words) as e:
            read_chat_template(bad)
        assert "\n" not in str(e.value)
    (tmp_path / "latin1.jinja").write_bytes(b"\xe9{{ 1 }}")
    with pytest.raises(TokenizerError, match="cannot read the chat template"):
        read_chat_template(tmp_path / "latin1.jinja")


def test_missing_template(tok_dir, tmp_path):
    d = copy_tok(tok_dir, tmp_path / "t")
    edit_json(d / "tokenizer_config.json", chat_template=None)
    t = Tokenizer.from_dir(d)
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template") as e:
        t.apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)


def test_eos_precedence(tok_dir, tmp_path):
    d = copy_tok(tok_dir, tmp_path / "t")
    im_end, eot = (
        Tokenizer.from_dir(d).token_to_id("<|im_end|>"),
        Tokenizer.from_dir(d).token_to_id("<|endoftext|>"),
    )
    edit_json(d / "generation_config.json", eos_token_id=[7, 8])
    edit_json(d / "config.json", eos_token_id=9)
    assert Tokenizer.from_dir(d).eos_token_ids == (7, 8)
    edit_json(d / "generation_config.json", eos_token_id=11)  # an int works too
    assert Tokenizer.from_dir(d).eos_token_ids == (11,)
    edit_json(d / "generation_config.json", eos_token_id=None)
    assert Tokenizer.from_dir(d).eos_token_ids == (9,)
    edit_json(d / "config.json", eos_token_id=None, text_config={"eos_token_id": [eot, 5]})  # wrapper layout
    assert Tokenizer.from_dir(d).eos_token_ids == (eot, 5)
    (d / "config.json").unlink()
    (d / "generation_config.json").unlink()
    assert Tokenizer.from_dir(d).eos_token_ids == (im_end,)  # tokenizer_config's eos_token


def test_malformed_eos_sources_are_named(tok_dir, tmp_path):
    """A generation_config.json that is not an object, or an eos_token_id that is not token ids: one-line
    errors naming the file (not an AttributeError, or int()'s message without a file)."""
    d = copy_tok(tok_dir, tmp_path / "t")
    for text, words in (
        ("[]", "generation_config.json must hold a JSON object"),
        ('{"eos_token_id": "<|im_end|>"}', "generation_config.json: eos_token_id must be a token id"),
        ('{"eos_token_id": [1, true]}', "eos_token_id must be a token id"),
    ):
        (d / "generation_config.json").write_text(text)
        with pytest.raises(TokenizerError, match=words) as e:
            Tokenizer.from_dir(d)
        assert "\n" not in str(e.value)
    (d / "generation_config.json").write_bytes(b"\xff{}")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_dir(d)


def test_missing_tokenizer_json(tok_dir, tmp_path):
    d = copy_tok(tok_dir, tmp_path / "t")
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json") as e:
        Tokenizer.from_dir(d)
    assert "\n" not in str(e.value)


def test_include_stop_keeps_the_stop_string(tok):
    """include_stop (vLLM's include_stop_str_in_output): the same stop, on the same token, and the text
    runs on to that stop string's end (the longest one starting there)."""
    rng = random.Random(7)
    cases = [("xxabcdyy", ["abcd", "bc"]), ("a 日本語 b", ["本語 b", "本語"]), ("one two", ["tw", "two"])]
    for _ in range(40):
        text = random_text(rng, rng.randint(2, 30))
        a = rng.randrange(len(text))
        cases.append((text, [text[a : a + rng.randint(1, 6)], random_text(rng, 2)]))
    for text, stops in cases:
        ids = tok.encode(text)
        _, det = stream(tok, ids, stops)
        inc = IncrementalDetokenizer(tok, stop=stops, include_stop=True)
        chunks = [inc.add(i) for i in ids] + [inc.finish()]
        assert inc.stopped == det.stopped and "".join(chunks) == inc.text
        if not det.stopped:
            assert inc.text == text
            continue
        tail = inc.text[len(det.text) :]
        assert inc.text.startswith(det.text) and tail in stops and text.startswith(inc.text)


def test_stop_strings_wait_for_min_tokens(tok):
    """min_tokens (vLLM's): stop strings are looked for only from the min_tokens-th token on: a stop in
    the text of earlier tokens passes, one after it still stops."""
    text = "ab END cd END ef"
    ids = tok.encode(text)
    at = next(k for k in range(1, len(ids) + 1) if "END" in tok.decode(ids[:k]))  # the first END's token
    for m, want in ((0, "ab "), (at + 1, None)):
        det = IncrementalDetokenizer(tok, stop=["END"], min_tokens=m)
        out = "".join(det.add(i) for i in ids) + det.finish()
        if want is not None:
            assert out == want and det.stopped
        else:  # the first END went out; the second stops
            assert det.stopped and out.startswith(tok.decode(ids[:at])) and out.count("END") == 1


def test_malformed_chat_templates_are_named_at_load(tmp_path):
    """A chat_template of the wrong shape in tokenizer_config.json, or a chat_template.jinja that is not
    UTF-8, is a TokenizerError naming the file at load (session 47: a TypeError there, or at the first
    chat request)."""
    d = tmp_path / "t"
    make_tokenizer_files(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    for bad in ([1, 2], ["name and template"], [{"name": "default", "template": 5}], 7):
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": bad}))
        with pytest.raises(TokenizerError, match="chat_template must be a string or a list"):
            Tokenizer.from_dir(d)
    named = [{"name": "default", "template": "{{ messages[0].content }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named}))
    Tokenizer.from_dir(d)
    (d / "chat_template.jinja").write_bytes(b"{{ messages \xff }}")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja is not valid UTF-8"):
        Tokenizer.from_dir(d)


def test_text_past_the_weights_vocabulary_is_refused_by_name(tok_dir):
    """With the weights' vocabulary set (LLM sets config.json's vocab_size), text that encodes to an id
    the weights lack is a TokenizerError that says the tokenizer does not match the weights (session 47: a
    torch IndexError from the embedding, on the GPU a read out of bounds); text within it encodes as ever."""
    t = Tokenizer.from_dir(tok_dir)
    top = t.token_to_id("<|im_end|>")
    assert top is not None and top >= 256
    t.model_vocab = top
    assert t.encode("plain text") == Tokenizer.from_dir(tok_dir).encode("plain text")
    with pytest.raises(TokenizerError, match=rf"'<\|im_end\|>' \(id {top}\), past the model's vocabulary"):
        t.encode("hi<|im_end|>")


def test_reasoning_reaches_a_template_under_the_name_it_reads(tok_dir):
    """An assistant turn's reasoning, sent as `reasoning` (vLLM's name) or `reasoning_content`, reaches a
    template that reads either name; a template that lists a message's keys sees it once, as given."""
    tok = Tokenizer.from_dir(tok_dir)
    for name in ("reasoning", "reasoning_content"):
        turn = {"role": "assistant", "content": "C", name: "T"}
        for source in (
            "{% for m in messages %}[{{ m.reasoning_content }}]{% endfor %}",
            "{% for m in messages %}[{{ m.reasoning }}]{% endfor %}",
            "{% for m in messages %}[{{ m.get('reasoning') or m['reasoning_content'] }}]{% endfor %}",
        ):
            tok.set_chat_template(source)
            assert tok.apply_chat_template([turn], add_generation_prompt=False) == "[T]", (name, source)
        tok.set_chat_template(
            "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}{% endfor %}"
        )
        assert (
            tok.apply_chat_template([turn], add_generation_prompt=False)
            == f"role=assistant;content=C;{name}=T;"
        )
