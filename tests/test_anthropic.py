"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` SDK:
the request becomes the chat request a client of /v1/chat/completions would send, the output its content
blocks, streamed or not, and errors have the API's shape."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does
pytest.importorskip("anthropic")

import json

import anthropic
import httpx
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from lumo.server.testing import ScriptedLLM, serve_in_thread

TOOL = {
    "name": "get_weather",
    "description": "weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
OUTPUT = "<think>\nNeed weather.\n</think>\n\nChecking." + XML_CALL
EVENT = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture
def scripted(tmp_path):
    llm = ScriptedLLM.with_test_tokenizer(tmp_path, OUTPUT)
    with serve_in_thread(llm, api_key="sk-ant") as url:
        yield llm, url, anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0, timeout=30)


def raw_events(url: str, body: dict) -> list[dict]:
    """A stream's events as sent: each SSE `event:` name is its data's type, each validates as the SDK's."""
    events = []
    with httpx.stream(
        "POST", url + "/v1/messages", json=body, headers={"x-api-key": "sk-ant"}, timeout=30
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                if name != "error":
                    EVENT.validate_python(data)
                events.append(data)
    return events


def test_blocks_streamed_and_not(scripted):
    """thinking, text, tool_use blocks with stop_reason tool_use; the stream's blocks open, fill and close
    in order and add up to the non-streamed message."""
    llm, url, client = scripted
    ask = dict(model="claude-sonnet-4-5", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}])
    m = client.messages.create(**ask, tools=[TOOL])
    assert m.model == "scripted" and m.role == "assistant" and m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking.strip() == "Need weather." and m.content[1].text == "Checking."
    call = m.content[2]
    assert call.name == "get_weather" and call.input == {"city": "New York", "days": 3} and call.id
    assert m.usage.input_tokens == len(llm.prompts[-1]) and m.usage.cache_read_input_tokens == 0
    assert m.usage.output_tokens > 0

    events = raw_events(url, {**ask, "tools": [TOOL], "stream": True})
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    blocks: list[dict] = []
    for e in events[1:-2]:  # start, deltas, stop for each block, in index order, one open at a time
        if e["type"] == "ping":
            continue
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append({**e["content_block"], "json": ""})
        else:
            assert e["index"] == len(blocks) - 1
        if e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[-1]
            if d["type"] == "signature_delta":  # a thinking block's last delta
                assert b["type"] == "thinking" and "signed" not in b
                b["signed"] = True
                continue
            assert "signed" not in b
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "json"}[d["type"]]
            b[key] += d["partial_json" if key == "json" else key]
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"] and blocks[0]["signed"]
    assert blocks[1]["text"] == "Checking." and json.loads(blocks[2]["json"]) == call.input

    with client.messages.stream(**ask, tools=[TOOL]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == call.input and final.stop_reason == "tool_use"


def test_conversation_renders_as_the_chat_request(scripted):
    """system, thinking, tool_use, tool_result (an error one too), a user's text after its results, a
    disabled thinking: the engine's prompt is the one the equivalent /v1/chat/completions request gives."""
    llm, url, client = scripted
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "R1", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Bergen"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "no station"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    client.messages.create(
        model="any",
        max_tokens=50,
        system=system,
        messages=messages,
        tools=[TOOL],
        thinking={"type": "disabled"},
    )
    call = lambda i, city: {  # noqa: E731
        "id": f"toolu_{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in \nOslo?"},  # text blocks stay apart
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "R1",
            "tool_calls": [call(1, "Oslo"), call(2, "Bergen")],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    tools = [{"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                               "parameters": TOOL["input_schema"]}}]  # fmt: skip
    body = {
        "messages": chat,
        "tools": tools,
        "max_tokens": 50,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-ant"}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert llm.prompts[-2] == llm.prompts[-1]
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert prompt.index("Oslo?") < prompt.index("R1") < prompt.index("sunny") < prompt.index("And tomorrow?")
    # count_tokens: that prompt's length
    n = client.messages.count_tokens(model="any", system=system, messages=messages, tools=[TOOL],
                                     thinking={"type": "disabled"})  # fmt: skip
    assert n.input_tokens == len(llm.prompts[-1])


def test_images_and_documents_are_notes(scripted):
    """A pasted image and the image a Read tool returned stay in Claude Code's history: each is a note that
    it was left out (a 400 would fail every later turn), in its place among the text."""
    llm, _, client = scripted
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "See this:"}, image]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [image, {"type": "text", "text": "map"}],
                },
                pdf,
            ],
        },
    ]
    client.messages.create(model="any", max_tokens=20, messages=messages, tools=[TOOL])
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    note = "[an image was left out: this model reads text only]"
    assert f"See this:\n{note}" in prompt and f"{note}\nmap" in prompt
    assert prompt.index("map") < prompt.index("[a document was left out: this model reads text only]")


def test_cut_tool_calls_and_context_limits(tmp_path):
    """A tool call that max_tokens cut short is max_tokens (not tool_use: no call to run), one the context
    cut is model_context_window_exceeded; a prompt the context cannot hold is the API's "prompt is too
    long"."""
    out = "Checking." + XML_CALL
    llm = ScriptedLLM.with_test_tokenizer(tmp_path, out, chunk=len(out) - 8)  # two chunks, cut in the call
    llm.generate_stream = _cut(llm.generate_stream)
    llm.max_model_len = 2000
    with serve_in_thread(llm) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=30)
        ask = dict(model="x", messages=[{"role": "user", "content": "Weather?"}], tools=[TOOL])
        m = client.messages.create(**ask, max_tokens=5)
        # the incomplete call is there, as the API sends it, but stop_reason says not to run it
        assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["text", "tool_use"]
        m = client.messages.create(**ask, max_tokens=32000)  # more than the context holds: cut, not refused
        assert m.stop_reason == "model_context_window_exceeded"
        with pytest.raises(anthropic.BadRequestError, match="prompt is too long: .* tokens > 1999 maximum"):
            client.messages.create(
                model="x", max_tokens=5, messages=[{"role": "user", "content": "hi " * 3000}]
            )


def _cut(generate_stream):
    """The scripted engine's stream with its last chunk ending on the length limit (as max_tokens does)."""

    def stream(prompt, max_tokens=256, **kw):
        chunks = list(generate_stream(prompt, max_tokens, **kw))
        chunks[-1].finish_reason = "length"
        yield from chunks[:-1]
        yield type(chunks[-1])(chunks[-1].text[:-20], chunks[-1].token_ids, "length")

    return stream


def test_thinking_follows_the_api(scripted):
    """No `thinking` is no extended thinking (the template's enable_thinking false), as in the API."""
    _, _, client = scripted
    ask = dict(model="x", messages=[{"role": "user", "content": "hi"}])
    absent = client.messages.count_tokens(**ask).input_tokens
    off = client.messages.count_tokens(**ask, thinking={"type": "disabled"}).input_tokens
    on = client.messages.count_tokens(**ask, thinking={"type": "enabled", "budget_tokens": 2000}).input_tokens
    assert absent == off != on


def test_pings_while_waiting():
    import asyncio

    from lumo.server.app import _with_pings

    async def slow():
        await asyncio.sleep(0.25)
        yield 1
        yield 2

    async def run() -> list:
        return [x async for x in _with_pings(slow(), 0.1)]

    got = asyncio.run(run())
    assert got[-2:] == [1, 2] and got[:-2] == [None] * len(got[:-2]) and len(got) >= 4


def test_prefilled_assistant_turn_is_continued(scripted):
    llm, url, client = scripted
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
    client.messages.create(model="x", max_tokens=5, messages=messages)
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert prompt.endswith("Hi, I am")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages must not be empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "not user, assistant or system"),
        ({"messages": [{"role": "system", "content": "x"}]}, "need a user or assistant message"),
        (
            {"messages": [{"role": "user", "content": [{"type": "container_upload", "file_id": "f"}]}]},
            "'container_upload' is not supported",
        ),
        (  # an image in an assistant message: not something the API has
            {"messages": [{"role": "assistant", "content": [{"type": "image", "source": {}}]}]},
            "'image' is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "a", "input": {}}]}]},
            "user message",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tool type"),
        ({"tools": [{"type": "computer_20250124", "name": "computer"}]}, "tool type"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"tool_choice": {"type": "any"}}, "non-empty tools"),
        ({"temperature": 1.5}, "temperature"),
        ({"system": [{"type": "image"}]}, "system"),
        # a text block without its text says so (it read "type 'text' is not supported" before session 47)
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a text block needs `text`"),
        ({"system": [{"type": "text", "text": 5}]}, "a text block needs `text`"),
    ],
)
def test_bad_requests_are_anthropic_shaped_400s(scripted, change, words):
    _, url, _ = scripted
    body = {"model": "x", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": "sk-ant"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert words in err["error"]["message"], err


def test_key_and_errors_through_the_sdk(scripted):
    _, url, client = scripted
    bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        client.messages.create(
            model="x", max_tokens=5, messages=[{"role": "user", "content": [{"type": "bogus"}]}]
        )
    r = httpx.post(url + "/v1/messages", content=b"{not json", headers={"x-api-key": "sk-ant"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_engine_failure_mid_stream_is_an_error_event(tmp_path):
    llm = ScriptedLLM.with_test_tokenizer(tmp_path, OUTPUT, fail_after=4)
    with serve_in_thread(llm, api_key="sk-ant") as url:
        body = {
            "model": "x",
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        }
        events = raw_events(url, body)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] == "api_error" and "scripted failure" in events[-1]["error"]["message"]


@pytest.mark.skipif(
    not __import__("lumo.engine.llm").engine.llm.embedded_model_path().exists(), reason="no model"
)
def test_stop_reasons_with_the_embedded_model():
    """end_turn / max_tokens / stop_sequence (the string that matched), and the text the engine gives."""
    from lumo.engine.llm import LLM

    llm = LLM(device="cpu", spec="off")
    with serve_in_thread(llm) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
        ask = dict(
            model="x",
            messages=[{"role": "user", "content": "Write a Python function."}],
            extra_body={
                "temperature": 0.0
            },  # the SDK (2.x) has no temperature argument; older clients send it
        )
        long = client.messages.create(**ask, max_tokens=40)
        text = long.content[-1].text
        assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 40
        k = next(k for k in range(len(text) // 2, len(text) - 3) if text[k : k + 3].strip())
        stop = text[k : k + 3]  # the text ends before its first occurrence
        m = client.messages.create(**ask, max_tokens=40, stop_sequences=["@@never@@", stop])
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
        assert m.content[-1].text == text[: text.index(stop)]
        # a prompt past the CPU's 512-token snapshot grid, twice: the second reads its prefix up to the last
        # grid point before its end from the prefix cache, reported as Anthropic's cache reads
        code = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(80))
        long_ask = {**ask, "messages": [{"role": "user", "content": code}]}
        first = client.messages.create(**long_ask, max_tokens=1).usage
        u = client.messages.create(**long_ask, max_tokens=1).usage
        assert first.input_tokens > 512 and u.cache_read_input_tokens == (first.input_tokens - 1) // 512 * 512
        assert (
            u.input_tokens + u.cache_read_input_tokens == first.input_tokens + first.cache_read_input_tokens
        )
        again = client.messages.create(**ask, max_tokens=1)
        assert Message.model_validate(again.model_dump()).stop_reason in ("max_tokens", "end_turn")


class _Structured(ScriptedLLM):
    """Records the structured output each request asked for (a scripted output follows no grammar)."""

    def constraint(self, structured, prompt_ids):
        self.asked = structured


def test_structured_output_and_threads(tmp_path):
    """output_config.format (the SDK's messages.parse, LangChain's json_schema method) and the beta's
    output_format (LiteLLM) are the JSON schema the reply follows, the chat's json_schema grammar; another
    format type is a 400. A request that names a message thread (the SDK's tool runner sends
    `thread` by default) is a 400 with the error code the SDK recovers from by resending the whole history,
    not an answer to a prompt that holds only the last tool result."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    llm = _Structured.with_test_tokenizer(tmp_path, '{"name": "Ada"}')
    ask = dict(model="claude-sonnet-4-5", max_tokens=50, messages=[{"role": "user", "content": "Who?"}])
    with serve_in_thread(llm) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=30)
        for extra in (
            {"output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}},
            {"output_format": {"type": "json_schema", "schema": schema}},
        ):
            llm.asked = None
            m = client.messages.create(**ask, extra_body=extra)
            assert m.content[-1].text == '{"name": "Ada"}' and llm.asked.json == schema, extra
        for extra, where in (
            ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
            ({"output_format": {"type": "json_schema"}}, "output_format.schema"),
            ({"output_config": "json"}, "output_config"),
        ):
            with pytest.raises(anthropic.BadRequestError, match=where.replace(".", r"\.")):
                client.messages.create(**ask, extra_body=extra)
        r = httpx.post(
            url + "/v1/messages",
            json={**ask, "thread": {"type": "create"}},
            headers={"x-api-key": "x"},
            timeout=10,
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and "thread" in err["message"]
        assert err["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
        assert client.messages.create(**ask, extra_body={"thread": False}).content  # off: served


def test_the_api_defined_client_tools(scripted):
    """The bash and text editor tools the API defines (the client runs them) are function tools with the
    input the API defines: the template shows them, and a call comes back as their tool_use; the text
    editor before 2025-04-29 also has undo_edit."""
    from lumo.server.anthropic import MessagesRequest

    llm, _, client = scripted
    tools = [
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 10000},
    ]
    ask = dict(model="x", max_tokens=200, messages=[{"role": "user", "content": "Fix it."}])
    client.messages.create(**ask, tools=tools)
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert "str_replace_based_edit_tool" in prompt and "insert_line" in prompt and "restart" in prompt
    chat = MessagesRequest.model_validate({**ask, "tools": tools}).to_chat()
    editor = chat.tools[1].function.parameters
    assert editor["properties"]["command"]["enum"] == ["view", "create", "str_replace", "insert"]
    assert editor["required"] == ["command", "path"]
    old = MessagesRequest.model_validate({**ask, "tools": [{"type": "text_editor_20250124", "name": "e"}]})
    assert "undo_edit" in old.to_chat().tools[0].function.parameters["properties"]["command"]["enum"]
