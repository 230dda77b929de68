"""Chat output parsing: `<think>` -> reasoning_content, `<tool_call>` (JSON and XML forms) -> tool_calls.

Every case is fed whole, character by character and split in two at every position; all must agree with
the expected result. One HTTP test runs the real app over loopback with a scripted engine (random-weight
models never emit tool calls), streamed and not, through the official openai client.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import json

import httpx
import openai

from lumo.server.testing import scripted_server
from lumo.server.toolparse import ChatOutputParser, ParsedDelta, parse_tool_call

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    }
]

XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    '<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n<parameter=note>\n42\n</parameter>\n'
    "<parameter=extra>\nline 1\nline <2>\n</parameter>\n</function>\n</tool_call>"
)
THINK = "<think>\nNeed weather.\n</think>\n\nChecking."  # the scripted output's reasoning and text
XML_ARGS = {
    "city": "New York",
    "days": 3,
    "metric": True,
    "opts": {"a": [1, 2]},
    "note": "42",
    "extra": "line 1\nline <2>",
}

# (name, output text, in_reasoning, parse_tools, expected content, expected reasoning, expected calls)
CASES = [
    ("plain", "Hello, world!  How are you?", False, True, "Hello, world!  How are you?", "", []),
    # the output's own leading and trailing whitespace is kept (a continued line's indentation, the text
    # before a stop string); whitespace that only separates parts is not
    ("own-whitespace", "    return x\n\n", False, True, "    return x\n\n", "", []),
    ("trailing-blank", "# ", False, True, "# ", "", []),
    ("after-think", "<think>\nhm\n</think>\n\n  Answer. ", False, True, "Answer. ", "\nhm\n", []),
    (
        "around-call",
        ' a \n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n ',
        False,
        True,
        " a",
        "",
        [("a", {})],
    ),
    (
        "angle-brackets",
        "a < b and <tool> or <think or </tool_call",
        False,
        True,
        "a < b and <tool> or <think or </tool_call",
        "",
        [],
    ),
    (
        "json-call",
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        False,
        True,
        "Let me check.",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "two-calls",
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "b", "arguments": {"x": "<y>"}}\n</tool_call>\n',
        False,
        True,
        "",
        "",
        [("a", {}), ("b", {"x": "<y>"})],
    ),
    ("xml-call", "Sure." + XML_CALL, False, True, "Sure.", "", [("get_weather", XML_ARGS)]),
    (
        "think",
        "<think>\nThe user wants x.\n</think>\n\nHere is x.",
        False,
        True,
        "Here is x.",
        "\nThe user wants x.\n",
        [],
    ),
    (
        "think-opened-by-template",
        "I should call it.\n</think>\n\n" + XML_CALL,
        True,
        True,
        "",
        "I should call it.\n",
        [("get_weather", XML_ARGS)],
    ),
    (
        "call-inside-reasoning-never-closed",
        "Let me look.\n" + XML_CALL + "\n",
        True,
        True,
        "",
        "Let me look.\n\n",
        [("get_weather", XML_ARGS)],
    ),
    (
        "call-inside-reasoning-then-content",
        '<think>\nNeed data. <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>'
        " then\n</think>\n\nDone.",
        False,
        True,
        "Done.",
        "\nNeed data.  then\n",
        [("a", {"k": 1})],
    ),
    (
        "call-in-reasoning-cut-by-think-close",
        "<think>maybe <tool_call> later</think>ok",
        False,
        True,
        "ok",
        "maybe <tool_call> later",
        [],
    ),
    (
        "garbage-call-in-reasoning-stays",
        "I try <tool_call>{not json}</tool_call> again",
        True,
        True,
        "",
        "I try <tool_call>{not json}</tool_call> again",
        [],
    ),
    (
        "call-in-reasoning-tools-off",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>',
        True,
        False,
        "",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "reasoning-unfinished",
        "still thinking <tool_call> about </thin",
        True,
        True,
        "",
        "still thinking <tool_call> about </thin",
        [],
    ),
    (
        "malformed-call",
        "x <tool_call>\n{not json}\n</tool_call> y",
        False,
        True,
        "x<tool_call>\n{not json}\n</tool_call> y",
        "",
        [],
    ),
    (
        "unclosed-call-parses",
        '<tool_call>\n{"name": "a", "arguments": {"k": 1}}\n',
        False,
        True,
        "",
        "",
        [("a", {"k": 1})],
    ),
    ("unclosed-call-garbage", 'ok <tool_call>\n{"name": ', False, True, 'ok<tool_call>\n{"name": ', "", []),
    (
        "tools-off",
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>',
        False,
        False,
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>',
        "",
        [],
    ),
    (
        "string-arguments",
        '<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>',
        False,
        True,
        "",
        "",
        [("a", {"k": 2})],
    ),
]


def _run(pieces: list[str], in_reasoning: bool, parse_tools: bool, raw: bool = False):
    """Content, reasoning and the tool calls (name, parsed arguments; raw: the arguments' text) the parser
    gives over these deltas; checks the streamed pieces: each call named once by its first piece, with a
    fresh id, numbered in order, the arguments of a call continuing only that call's."""
    p = ChatOutputParser(in_reasoning=in_reasoning, parse_tools=parse_tools, tools=TOOLS)
    total, named = ParsedDelta(), []
    for d in [p.feed(x) for x in pieces] + [p.finish()]:
        for piece in d.tool_calls:
            if piece.id is not None:
                assert piece.index == len(named) and piece.name and piece.id.startswith("call_")
                named.append(piece.id)
            else:
                assert piece.index == len(named) - 1 and piece.name is None and piece.arguments
        total.extend(d)
    calls = total.calls()
    assert len(set(named)) == len(calls) == p.n_tool_calls
    for kind in ("content", "reasoning"):  # the ordered parts hold the same text
        assert "".join(v for k, v in total.parts if k == kind) == getattr(total, kind)
    if raw:
        return total.content, total.reasoning, [(c.name, c.arguments) for c in calls]
    return total.content, total.reasoning, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parser_every_split(case):
    _, text, in_reasoning, parse_tools, content, reasoning, calls = case
    expected = (content, reasoning, calls)
    assert _run([text], in_reasoning, parse_tools) == expected
    assert _run(list(text), in_reasoning, parse_tools) == expected
    for i in range(len(text) + 1):
        assert _run([text[:i], text[i:]], in_reasoning, parse_tools) == expected, f"split at {i}"


def test_parser_holds_back_only_tag_prefixes():
    p = ChatOutputParser(tools=TOOLS)
    assert p.feed("Hello <tool").content == "Hello"
    d = p.feed('_call>\n{"name": "a", "arguments": {}}')
    assert not d  # inside a tool call nothing is sent until it closes
    d = p.feed("\n</tool_call>")
    assert [c.name for c in d.tool_calls] == ["a"]
    assert p.feed("<thinker").content == "<thinker"  # not a tag after all


def test_parse_tool_call_rejects_non_calls():
    assert parse_tool_call("[1, 2]") is None
    assert parse_tool_call('{"arguments": {}}') is None
    assert parse_tool_call("<function>no name</function>") is None
    assert parse_tool_call('{"name": "f", "arguments": "not json"}') is None


@pytest.mark.parametrize(
    "body, arguments",
    [
        ('{"name": "f", "arguments": {"a": 1}}', {"a": 1}),
        ('{"name": "f", "parameters": {"a": 1}}', {"a": 1}),
        ('{"name": "f"}', {}),
        ('{"name": "f", "arguments": null}', {}),
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', {"a": 1}),  # double-encoded
        ('{"name": "f", "arguments": [1, 2]}', None),
        ('{"name": "f", "arguments": 5}', None),
        ('{"name": "f", "arguments": "[1]"}', None),
        ('{"name": "f", "arguments": "null"}', None),
    ],
)
def test_tool_call_arguments_are_objects(body, arguments):
    """OpenAI's clients parse a call's arguments as an object and Anthropic's API requires one: none is
    {}, anything else leaves the text as text."""
    call = parse_tool_call(body)
    if arguments is None:
        assert call is None
    else:
        assert call.name == "f" and json.loads(call.arguments) == arguments


# ---------------------------------------------------------------------------------------------
# HTTP, with a scripted engine behind the real app


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The app over a scripted engine: reasoning, text, then two XML calls."""
    calls = XML_CALL + "\n" + XML_CALL.replace("New York", "Oslo")
    with scripted_server(tmp_path_factory.mktemp("tok"), THINK + calls) as served:
        yield served


def test_http_tool_calls_streamed_and_not(scripted):
    llm, url = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Weather in New York and Oslo?"}]
    r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, tool_choice="auto")
    # the template saw the tools
    assert "get_weather" in llm.tokenizer.decode(llm.prompts[-1])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking."
    assert msg.model_extra["reasoning_content"] == "\nNeed weather.\n"
    assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["New York", "Oslo"]
    assert json.loads(msg.tool_calls[0].function.arguments) == XML_ARGS
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    assert r.usage.completion_tokens == len(range(0, len(llm.output), 3))

    stream = client.chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    content, reasoning, calls, finish, usage = "", "", {}, None, None
    for ev in stream:
        usage = ev.usage or usage
        if not ev.choices:
            continue
        delta = ev.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": "", "deltas": 0})
            assert (tc.id is not None) == (entry["id"] is None)  # the first delta of a call names it
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
            entry["deltas"] += 1
        finish = ev.choices[0].finish_reason or finish
    assert (content, reasoning, finish) == ("Checking.", "\nNeed weather.\n", "tool_calls")
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_weather"]
    assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["New York", "Oslo"]
    assert json.loads(calls[0]["arguments"]) == XML_ARGS
    assert all(c["deltas"] > 5 for c in calls.values())  # the arguments streamed, not sent whole
    assert usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens == len(llm.prompts[-1])

    # tool_choice "none": the same output stays text
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": messages, "tools": TOOLS, "tool_choice": "none"},
        timeout=10,
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert "<tool_call>" in r["choices"][0]["message"]["content"]
    assert "tool_calls" not in r["choices"][0]["message"]


def test_reasoning_under_both_names_and_a_cut_reasoning_has_null_content(scripted, tmp_path):
    """vLLM's name for the reasoning since late 2025, `reasoning`, beside the older `reasoning_content` that
    clients still read, in a message and in the deltas; an output cut inside its reasoning has null
    content (vLLM's); an assistant turn sent back with either name renders the same prompt, its reasoning
    in it (helper-94: one sent as `reasoning` was dropped)."""
    llm, url = scripted
    user = [{"role": "user", "content": "Weather?"}]

    def chat(**body) -> dict:
        return httpx.post(url + "/v1/chat/completions", json={"messages": user, **body}, timeout=10).json()

    msg = chat(tools=TOOLS)["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "\nNeed weather.\n"
    from lumo.server.testing import serve_in_thread

    with serve_in_thread(_cut_by_the_limit(tmp_path, "<think>\nStill thinking")[0]) as cut_url:
        body = {"messages": user, "max_tokens": 3}
        cut = httpx.post(cut_url + "/v1/chat/completions", json=body, timeout=10).json()["choices"][0]
        body["include_reasoning"] = False  # the reasoning hidden: still no content
        hidden = httpx.post(cut_url + "/v1/chat/completions", json=body, timeout=10).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    assert cut["message"]["reasoning"] == cut["message"]["reasoning_content"] == "\nStill thinking"
    assert hidden["message"] == {"role": "assistant", "content": None}
    text = httpx.post(url + "/v1/chat/completions", json={"messages": user, "stream": True}, timeout=10).text
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in text.split("\n\n") if x.startswith("data: {")]
    for name in ("reasoning", "reasoning_content"):
        assert "".join(d.get(name) or "" for d in deltas) == "\nNeed weather.\n", name
    prompts = []
    for name in ("reasoning", "reasoning_content"):
        turn = {"role": "assistant", "content": "Checking.", name: "Earlier thought."}
        chat(messages=[*user, turn], max_tokens=1)
        prompts.append(llm.tokenizer.decode(llm.prompts[-1]))
    assert prompts[0] == prompts[1] and "Earlier thought." in prompts[0]


def test_include_reasoning_false_leaves_reasoning_out(scripted):
    """vLLM's include_reasoning: false: the reasoning is parsed (the content and calls are the same) but not
    returned, streamed or not."""
    _, url = scripted
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "include_reasoning": False}
    full = httpx.post(
        url + "/v1/chat/completions", json={**body, "include_reasoning": True}, timeout=10
    ).json()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10).json()
    msg, with_reasoning = r["choices"][0]["message"], full["choices"][0]["message"]
    assert with_reasoning["reasoning"] == with_reasoning["reasoning_content"] == "\nNeed weather.\n"
    assert "reasoning_content" not in msg and "reasoning" not in msg
    assert msg["content"] == with_reasoning["content"] == "Checking."
    assert [c["function"] for c in msg["tool_calls"]] == [c["function"] for c in with_reasoning["tool_calls"]]
    text = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10).text
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in text.split("\n\n") if x.startswith("data: {")]
    assert not any("reasoning_content" in d or "reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Checking." and "get_weather" in text


def test_logprobs_asked_of_an_engine_without_them(scripted):
    """An engine whose chunks carry no logprobs (this scripted one) answers logprobs requests with null /
    empty entries, never an error."""
    _, url = scripted
    body = {"prompt": "hi", "max_tokens": 5, "logprobs": 2, "echo": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == {None}
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"] == []


def test_xml_call_streams_its_arguments():
    """An XML call goes out while it is generated: its id and name once `<function=NAME>` is whole, a
    string value's text before its parameter closes; the arguments' text is json.dumps of the whole call's
    (typed) values, however the output is split."""
    p = ChatOutputParser(tools=TOOLS)
    head = XML_CALL[: XML_CALL.index("\n<parameter=city>")]
    d = p.feed(head)
    assert [(c.index, c.name, c.arguments) for c in d.tool_calls] == [(0, "get_weather", "")]
    d = p.feed("\n<parameter=city>\nNew Yo")
    assert [c.arguments for c in d.tool_calls] == ['{"city": "New Yo']
    d = p.feed("rk\n")  # the newline may be the template's: held until the parameter goes on or ends
    assert [c.arguments for c in d.tool_calls] == ["rk"]
    d = p.feed("</parameter>\n<parameter=days>\n3")
    assert [c.arguments for c in d.tool_calls] == ['", "days": ']  # a typed value waits for its end
    want = json.dumps(XML_ARGS, ensure_ascii=False)
    for pieces in ([XML_CALL], list(XML_CALL), [XML_CALL[:40], XML_CALL[40:97], XML_CALL[97:]]):
        assert _run(pieces, False, True, raw=True) == ("", "", [("get_weather", want)])


def _xml_reference(body: str) -> tuple[dict, bool]:
    """The XML form's arguments by regular expressions over the whole body (the parser's specification):
    a parameter's value runs to `</parameter>`, the next `<parameter=` or the end of the function; and
    whether every parameter name came once. (Not modelled: a typed value whose JSON holds one of those
    tags in a string, test_xml_typed_values_hold_tags_in_their_json.)"""
    import re

    from lumo.server.toolparse import _typed_value

    fn = re.match(r"\s*<function=([^>\n]+)>(.*?)(?:</function>.*)?\Z", body, re.S)
    props = TOOLS[0]["function"]["parameters"]["properties"]
    args, n = {}, 0
    for m in re.finditer(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", fn.group(2), re.S):
        value = m.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[m.group(1).strip()] = _typed_value(value, props.get(m.group(1).strip()))
        n += 1
    return args, n == len(args)


def test_xml_arguments_match_the_whole_body_parse():
    """Random XML bodies (values with newlines, angle brackets, tag look-alikes, empty values, unclosed
    parameters, typed and untyped parameters), fed whole, character by character and in random pieces:
    the streamed arguments are the whole-body parse's: the same text (json.dumps of it) where no parameter
    came twice."""
    import random

    rng = random.Random(5)
    atoms = ["a", "x y", "\n", "\n\n", "<", ">", "</", "</par", "<parameter", "<p>", "1", "[2]", '"q"', "é"]
    atoms += ["</function>", "<parameter=b</function>", "</func", '"\\']
    for _ in range(300):
        body = "<function=get_weather>"
        for _ in range(rng.randint(0, 4)):
            key = rng.choice(["city", "days", "metric", "opts", "note", "free", " city "])
            value = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 6)))
            if key in ("days", "metric", "opts") and rng.random() < 0.7:
                value = rng.choice(["\n3\n", "\ntrue\n", '\n{"a": 1}\n', "\nnot json\n"])
            body += f"\n<parameter={key}>{value}" + rng.choice(["</parameter>", "", "\n</parameter>"])
        body += rng.choice(["\n</function>\n", "\n</function>", "", "\n"])
        text = "<tool_call>\n" + body + rng.choice(["</tool_call>", ""])
        want, unique = _xml_reference(body)
        splits = [[text], list(text)]
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
        for pieces in splits:
            content, _, calls = _run(pieces, False, True)
            assert content == "" and calls == [("get_weather", want)], (body, pieces)
            if unique:
                raw = _run(pieces, False, True, raw=True)[2]
                assert raw == [("get_weather", json.dumps(want, ensure_ascii=False))], (body, pieces)


def test_xml_typed_values_hold_tags_in_their_json():
    """A typed value ends at the first tag before which it is whole JSON (a boolean also as Jinja writes
    it), so its strings may hold `</parameter>`, `<parameter=` and `</function>`; one that is never whole
    (the model wrote no JSON) ends at its first tag, as before. Whole and streamed character by character."""
    opts = {"a": "x</parameter>\n<parameter=city>\ny", "b": ["</function>"]}
    body = (
        f"<function=get_weather>\n<parameter=opts>\n{json.dumps(opts)}\n</parameter>\n"
        "<parameter=metric>\nFalse\n</parameter>\n<parameter=city>\nOslo\n</parameter>\n</function>"
    )
    want = {"opts": opts, "metric": False, "city": "Oslo"}
    bad = "<function=get_weather>\n<parameter=days>\nthree </function> x\n</parameter>\n</function>"
    for text, args in ((body, want), (bad, {"days": "three "})):
        call = "<tool_call>\n" + text + "\n</tool_call>"
        assert (
            json.loads(
                parse_tool_call(
                    text, {"get_weather": TOOLS[0]["function"]["parameters"]["properties"]}
                ).arguments
            )
            == args
        )
        for pieces in ([call], list(call)):
            assert _run(pieces, False, True) == ("", "", [("get_weather", args)]), pieces


def test_malformed_schema_types_are_text():
    """A `type` that is not a name (an object, a nested list) does not break the parser: text."""
    from lumo.server.toolparse import is_text

    assert (
        is_text({"type": {"x": 1}})
        and is_text({"type": ["string", ["x"]]})
        and not is_text({"type": "integer"})
    )


def test_parts_keep_the_text_order():
    """ParsedDelta.parts: reasoning, content, a tool call and more content in the order of the text, fed
    whole or in pieces (the Responses API's items follow it)."""
    text = "<think>r</think>A" + XML_CALL + "\nB"
    for pieces in ([text], list(text), [text[:30], text[30:]]):
        p, total = ChatOutputParser(tools=TOOLS), ParsedDelta()
        for x in pieces:
            total.extend(p.feed(x))
        total.extend(p.finish())
        assert [k for k, _ in total.parts] == ["reasoning", "content", "tool", "content"]
        assert [v for k, v in total.parts if k != "tool"] == ["r", "A", "B"]


def test_parameter_types_follow_refs_once():
    """schema_types follows each `$ref` once: a schema whose references repeat or cycle costs its size
    (a request's tools are read on the event loop), and a cycle reads as any type (text)."""
    import time

    from lumo.server.toolparse import schema_types

    root = {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}] * 64}}}
    t0 = time.perf_counter()
    assert schema_types({"$ref": "#/$defs/A"}, root) == {None}
    chain = {f"A{i}": {"anyOf": [{"$ref": f"#/$defs/A{i + 1}"}] * 4} for i in range(40)}
    chain["A40"] = {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert schema_types({"$ref": "#/$defs/A0"}, {"$defs": chain}) == {"integer", "null"}
    assert time.perf_counter() - t0 < 1.0  # 4^40 walks without the memo


def _cut_by_the_limit(tmp_path, out: str):
    """A scripted engine that writes `out` and ends on the token limit (finish_reason length), and its own
    stream (ending on a stop) to put back."""
    from lumo.server.testing import ScriptedLLM

    llm = ScriptedLLM.with_test_tokenizer(tmp_path, out)
    generate = llm.generate_stream

    def cut(prompt, max_tokens=256, **kw):
        chunks = list(generate(prompt, max_tokens, **kw))
        chunks[-1].finish_reason = "length"
        yield from chunks

    llm.generate_stream = cut
    return llm, generate


def test_a_call_cut_by_the_token_limit_keeps_its_cut_arguments(tmp_path):
    """finish_reason length inside an XML call: the call is there with its arguments cut where the output
    stopped (not JSON), as OpenAI's API sends them, so that clients which run whatever is in tool_calls
    (LangChain puts it in invalid_tool_calls) do not run a call whose values were cut; streamed and not;
    the Responses API's function_call item is incomplete with the same arguments. A call that the engine
    ended itself (stop) is still parsed as it stands."""
    from lumo.server.testing import serve_in_thread

    out = THINK + "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    out += "<parameter=note>\nline one\nline tw"
    llm, generate = _cut_by_the_limit(tmp_path, out)
    messages = [{"role": "user", "content": "Weather?"}]
    with serve_in_thread(llm) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
        assert r.choices[0].finish_reason == "length"
        (call,) = r.choices[0].message.tool_calls
        args = call.function.arguments
        assert call.function.name == "get_weather" and args.startswith(
            '{"city": "New York", "note": "line one'
        )
        with pytest.raises(json.JSONDecodeError):
            json.loads(args)
        stream = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, stream=True)
        streamed, finish = "", None
        for ev in stream:
            for tc in ev.choices[0].delta.tool_calls or [] if ev.choices else []:
                streamed += tc.function.arguments or ""
            finish = (ev.choices[0].finish_reason if ev.choices else None) or finish
        assert (streamed, finish) == (args, "length")
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        resp = client.responses.create(model="scripted", input="Weather?", tools=tools)
        item = next(i for i in resp.output if i.type == "function_call")
        assert resp.status == "incomplete" and item.status == "incomplete" and item.arguments == args
    llm.generate_stream = generate  # the engine's own stop: the call is closed as it stands
    with serve_in_thread(llm) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "New York", "note": "line one\nline tw"}


JSON_CALL_ARGS = (  # escapes, a surrogate pair, brackets and commas inside strings
    '{"city": "New \\"York\\" \\u00e9 \\ud83d\\ude00 [a, b}", "days": [1, 2], '
    '"opts": {"a": true, "b": null}, "n": -1.5}'
)
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + JSON_CALL_ARGS + "}\n</tool_call>"


def _cut_prefix_of(cut, full) -> bool:
    """Whether `cut` is what a JSON value `full` cut short may close into: whole members, the last one
    (a string, list or object) itself cut."""
    if isinstance(full, str):
        return isinstance(cut, str) and full.startswith(cut)
    if isinstance(full, list):
        return (
            isinstance(cut, list)
            and len(cut) <= len(full)
            and all(c == f for c, f in zip(cut[:-1], full, strict=False))
            and (not cut or _cut_prefix_of(cut[-1], full[len(cut) - 1]))
        )
    if isinstance(full, dict):
        keys = list(full)
        return (
            isinstance(cut, dict)
            and list(cut) == keys[: len(cut)]
            and all(cut[k] == full[k] for k in list(cut)[:-1])
            and (not cut or _cut_prefix_of(cut[keys[len(cut) - 1]], full[keys[len(cut) - 1]]))
        )
    return cut == full


@pytest.mark.parametrize("close", [False, True])
def test_a_json_call_cut_by_the_token_limit_is_a_call_at_every_cut(close):
    """A JSON-form call cut by the token limit (finish_reason length) at any character: once its name is
    whole it is a call, its arguments the text that came (not JSON), or with close_cut (Anthropic's API)
    the object of the members that were whole (a string cut inside kept, cut); before that it is left out.
    Its markup never reaches the content once `<tool_call>` is whole (before, the text may be the model's),
    and every split of the stream gives the same parts."""
    full = json.loads(JSON_CALL_ARGS)
    text = "Checking. " + JSON_CALL
    start = text.index("<tool_call>") + len("<tool_call>") - 1
    name_whole = text.index('"get_weather"') + len('"get_weather"')
    args_at = text.index(JSON_CALL_ARGS)
    args_end = args_at + len(JSON_CALL_ARGS)
    for end in range(start + 1, len(text)):  # to the last character of `</tool_call>`
        seen = []
        for pieces in ([text[:end]], [text[: end // 2], text[end // 2 : end]], list(text[:end])):
            p, total = ChatOutputParser(tools=TOOLS), ParsedDelta()
            for x in pieces:
                total.extend(p.feed(x))
            total.extend(p.finish(cut=True, close_cut=close))
            seen.append([(k, v if k != "tool" else (v.name, v.arguments)) for k, v in total.parts])
        assert seen[0] == seen[1] == seen[2], end
        assert "<tool_call>" not in total.content and total.content == "Checking.", end
        calls = total.calls()
        if end < name_whole:
            assert calls == [], end
            continue
        (call,) = calls
        assert call.name == "get_weather"
        json.dumps(call.arguments).encode("utf-8")  # no lone surrogate: a pair the cut split is left out
        if end >= args_end:  # whole arguments, whatever came after them (the brace, a split `</tool_call>`)
            assert json.loads(call.arguments) == full, end
        elif not close:
            assert call.arguments == text[args_at:end], end
        else:
            assert _cut_prefix_of(json.loads(call.arguments), full), (end, call.arguments)


def test_cut_calls_of_custom_tools_and_xml_calls_cut_inside_a_tag():
    """A custom tool's call cut short keeps the input text that came, whether the model wrote its JSON
    with json.dumps' spaces or without; an XML call cut inside a closing tag keeps no part of the tag in its
    value (Anthropic's closed input), nor the template's newline before it."""
    for head in ('{"name": "apply", "arguments": {"input": "', '{"name":"apply","arguments":{"input":"'):
        for close in (False, True):
            p = ChatOutputParser(tools=TOOLS, custom=["apply"])
            p.feed("<tool_call>\n" + head + "line one\\nline t")
            (call,) = p.finish(cut=True, close_cut=close).calls()
            assert (call.name, call.custom, call.arguments) == ("apply", True, "line one\nline t"), head
    for cut_at in ("\n</para", "\n<", "\n</function"):
        p = ChatOutputParser(tools=TOOLS)
        d = p.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis" + cut_at)
        d.extend(p.finish(cut=True, close_cut=True))
        (call,) = d.calls()
        assert json.loads(call.arguments) == {"city": "Paris"}, cut_at


def test_a_cut_json_call_through_the_three_apis(tmp_path):
    """The JSON-form call max_tokens cut (a forced tool call's form): chat's tool_calls with the arguments
    as they were cut and finish_reason length, streamed and not; the Responses API's incomplete
    function_call item; the Messages API's tool_use block with the whole members' input (a number at the
    cut may have had more digits: left out), stop_reason max_tokens. No `<tool_call>` text anywhere."""
    import anthropic

    from lumo.server.testing import serve_in_thread

    out = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "New York", "days": [1, 2'
    llm, _ = _cut_by_the_limit(tmp_path, out)
    messages = [{"role": "user", "content": "Weather?"}]
    with serve_in_thread(llm) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "Checking."
        (call,) = r.choices[0].message.tool_calls
        cut_args = '{"city": "New York", "days": [1, 2'
        assert (call.function.name, call.function.arguments) == ("get_weather", cut_args)
        stream = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, stream=True)
        streamed, text = "", ""
        for ev in stream:
            for tc in ev.choices[0].delta.tool_calls or [] if ev.choices else []:
                streamed += tc.function.arguments or ""
            text += (ev.choices[0].delta.content or "") if ev.choices else ""
        assert (text, streamed) == ("Checking.", call.function.arguments)
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        resp = client.responses.create(model="scripted", input="Weather?", tools=tools)
        item = next(i for i in resp.output if i.type == "function_call")
        assert resp.status == "incomplete" and item.status == "incomplete"
        assert item.arguments == call.function.arguments and "<tool_call>" not in resp.output_text
        ac = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=30)
        tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
        for stream in (False, True):
            ask = dict(model="x", max_tokens=50, messages=messages, tools=[tool])
            if stream:
                with ac.messages.stream(**ask) as s:
                    m = s.get_final_message()
            else:
                m = ac.messages.create(**ask)
            assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["text", "tool_use"]
            # "2" may have had more digits: left out
            assert m.content[0].text == "Checking."
            assert m.content[1].input == {"city": "New York", "days": [1]}
