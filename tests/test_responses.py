"""OpenAI's Responses API (POST /v1/responses) through the official client.

Text: the tiny random checkpoint served in a subprocess, each response compared with the same request through
/v1/chat/completions (the Responses endpoint is the chat machinery with other shapes). Tool calls and
reasoning: a scripted engine behind the real app (random-weight models never emit them).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import json
import threading
import time

import httpx
import openai
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from lumo.server.testing import ScriptedLLM, scripted_server, serve_in_thread, serve_subprocess
from lumo.testing import make_tiny_checkpoint

XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
THINK = "<think>\nNeed weather.\n</think>\n\nChecking."  # the scripted output's reasoning and text
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4, mtp_num_hidden_layers=0)
    with serve_subprocess(ckpt, "--device", "cpu", env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    calls = XML_CALL + "\n" + XML_CALL.replace("New York", "Oslo")
    with scripted_server(tmp_path_factory.mktemp("tok"), THINK + calls) as (llm, url):
        yield llm, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def _model(client) -> str:
    return client.models.list().data[0].id


EVENT = TypeAdapter(ResponseStreamEvent)


def _raw_events(url: str, body: dict) -> list[dict]:
    """A streamed response's events as sent: each SSE `event:` name is its data's type, and every event
    (and each response object in them) validates against the official SDK's models."""
    events = []
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                obj = json.loads(line[len("data: ") :])
                assert obj["type"] == name
                EVENT.validate_python(obj)
                if "response" in obj:
                    Response.model_validate(obj["response"])
                events.append(obj)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _check_item_order(events: list[dict]) -> None:
    """Each item in turn: added, (part added, deltas, text done, part done | argument deltas, done), done."""
    open_index = None
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_index is None
            open_index = e["output_index"]
        elif kind == "response.output_item.done":
            assert open_index == e["output_index"]
            open_index = None
        elif "output_index" in e:
            assert open_index == e["output_index"], kind
    assert open_index is None


def test_text_is_the_chat_endpoints(client):
    """A string input, instructions, max_output_tokens, greedy: the chat endpoint's text and token counts;
    cut by max_output_tokens: status incomplete."""
    model = _model(client)
    r = client.responses.create(
        model=model, input="Hello, how are you?", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, how are you?"},
    ]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.id.startswith("resp_") and r.model == model and r.object == "response"
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello, how are you?"}]}]
    again = client.responses.create(
        model=model, input=items, instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert again.output_text == r.output_text  # a message item with text parts: the same prompt


def test_streamed_text(client, server):
    """Streamed: created, in_progress, the message item opened, its text deltas, closed, completed (or
    incomplete); the deltas are the final response's text; sequence numbers count from 0."""
    model = _model(client)
    kw = dict(model=model, input="Once upon a time", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    _check_item_order(_raw_events(server.url, kw))
    Response.model_validate(httpx.post(server.url + "/v1/responses", json=kw, timeout=60).json())


def test_tool_calls_and_reasoning(scripted):
    """Reasoning, a message and two function calls as output items, streamed and not; tool definitions
    reach the template; function_call / function_call_output input items render as a tool turn."""
    llm, client = scripted
    r = client.responses.create(model="scripted", input="Weather in New York and Oslo?", tools=[TOOL])
    assert "get_weather" in llm.tokenizer.decode(llm.prompts[-1])  # the template saw the tool
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "\nNeed weather.\n" and r.output_text == "Checking."
    calls = [o for o in r.output if o.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [
        {"city": "New York", "days": 3},
        {"city": "Oslo", "days": 3},
    ]
    assert all(c.call_id.startswith("call_") and c.name == "get_weather" for c in calls)

    events = list(client.responses.create(model="scripted", input="Weather?", tools=[TOOL], stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    assert [args[i] for i in (2, 3)] == [c.arguments for c in final.output[2:]]
    assert (
        "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nNeed weather.\n"
    )
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]

    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "R1"}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    client.responses.create(model="scripted", input=history, tools=[TOOL])
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    user, result = prompt.index("Weather in Oslo?"), prompt.index("sunny, 21 C")
    assert user < prompt.index("get_weather", user) < result  # the call, rendered between them
    assert user < prompt.index("R1") < result  # the reasoning item: the calls' assistant turn


def test_items_follow_the_text_when_a_chunk_holds_several(tmp_path):
    """One chunk with reasoning, text, a whole tool call and more text: the items come in the text's order
    and the call's arguments are whole; an engine failure mid-stream ends with error and response.failed."""
    text = "<think>\nR\n</think>\n\nChecking." + XML_CALL + "\nDone."
    llm = ScriptedLLM.with_test_tokenizer(tmp_path, text, chunk=len(text))
    with serve_in_thread(llm) as url:
        body = {"model": "scripted", "input": "Weather?", "tools": [TOOL]}
        events = _raw_events(url, body)
        _check_item_order(events)
        final = events[-1]["response"]
        kinds = ["reasoning", "message", "function_call", "message"]
        assert [o["type"] for o in final["output"]] == kinds
        assert json.loads(final["output"][2]["arguments"]) == {"city": "New York", "days": 3}
        texts = [o["content"][0]["text"] for o in final["output"] if o["type"] == "message"]
        assert texts == ["Checking.", "Done."]
        whole = httpx.post(url + "/v1/responses", json=body, timeout=30).json()
        assert [o.type for o in Response.model_validate(whole).output] == kinds
        llm.chunk, llm.fail_after = 5, 4
        events = _raw_events(url, body)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-1]["response"]["status"] == "failed" and "scripted failure" in events[-2]["message"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "a", "previous_response_id": "resp_1"}, "previous_response_id", "'resp_1' is not kept"),
        ({"input": "a", "conversation": "conv_1"}, "conversation", "not supported"),
        ({"input": "a", "background": True, "store": False}, "background", "background needs store"),
        ({"input": "a", "max_output_tokens": 10**6}, "max_output_tokens", "maximum context length"),
        ({"input": "a", "tools": [{"type": "local_shell"}]}, "tools[0]", "function and custom tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]},
            "input[0].content[0]",
            "text only",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "refusal"}]}]},
            "input[0].content[0]",
            "the refusal part needs `refusal`",
        ),
        (  # a hosted tool is left out, but a choice that forces one cannot be served
            {"input": "a", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice",
            "web_search",
        ),
        ({"input": "a", "text": {"format": {"type": "json_schema"}}}, "text", "json_schema"),
        ({"input": []}, "input", "empty"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "item 'x' is not known"),
        ({"input": [{"role": "robot", "content": "a"}]}, "input[0]", "robot"),
        ({"input": "a", "max_output_tokens": 0}, "max_output_tokens", ""),
        ({}, "input", ""),
        # malformed items and fields: 400s naming them, not 500s (session 38)
        (
            {"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "content": 5}]},
            "input[1]",
            "reasoning",
        ),
        (
            {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]}]},
            "input[0]",
            "text",
        ),
        ({"input": "a", "text": {"format": "json"}}, "text", "object"),
        ({"input": "a", "text": {"format": 5}}, "text", "object"),
        ({"input": "a", "tool_choice": "bogus"}, "tool_choice", ""),
        ({"input": "a", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools", ""),
        (  # the error names the tool's own index, past the hosted tool left out
            {"input": "a", "tools": [{"type": "web_search"}, {"type": "custom", "name": "p", "format": {}}]},
            "tools",
            "tools[1].custom.format",
        ),
        # a chat message's error names the input item it came from, not the chat message's index
        (
            {"instructions": "s", "input": [{"type": "function_call", "call_id": "c", "name": 5}]},
            "input",
            "input[0].name:",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {"type": "reasoning", "content": [{"text": "hm"}]},
                    {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "b", "name": None},
                ]
            },
            "input",
            "input[3].name:",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {"type": "function_call_output", "call_id": 5, "output": "x"},
                ]
            },
            "input",
            "input[1].call_id:",
        ),
        # the field and the reason named (session 47: "content part type 'input_text' is not supported",
        # and "input[1].content" for a tool output's `output`)
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0]",
            "the input_text part needs `text`",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": {"ok": True}}]},
            "input[0]",
            "input[0].output must be a string or a list of parts",
        ),
    ],
)
def test_bad_requests(server, body, param, words):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code in (400, 422), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_item_references_name_recent_items(scripted):
    """An input's item_reference names an item of an earlier response (the AI SDK's default OpenAI model
    sends earlier reasoning and messages so while `store` is not false): the item itself, rendered in its
    place, streamed responses' items too; an unknown id, or one of a response made with store false, is a
    400 that says why. A function call the client sends whole is kept with its id as well."""
    llm, client = scripted
    tools = [TOOL]
    first = client.responses.create(model="any", input="Weather?", tools=tools)
    reasoning, message, call = first.output[0], first.output[1], first.output[2]
    assert (reasoning.type, message.type, call.type) == ("reasoning", "message", "function_call")
    refs = [{"type": "item_reference", "id": reasoning.id}, {"type": "item_reference", "id": message.id}]
    turn = [{"role": "user", "content": "Weather?"}, *refs, call.model_dump(exclude_none=True)]
    turn += [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    client.responses.create(model="any", input=turn, tools=tools)
    with_refs = llm.tokenizer.decode(llm.prompts[-1])
    whole = [{"role": "user", "content": "Weather?"}, reasoning.model_dump(exclude_none=True)]
    whole += [message.model_dump(exclude_none=True), *turn[3:]]
    client.responses.create(model="any", input=whole, tools=tools)
    assert with_refs == llm.tokenizer.decode(llm.prompts[-1]) and "Checking." in with_refs
    # a streamed response's items, and the call item the client sent with its id
    with client.responses.stream(model="any", input="Weather?", tools=tools) as s:
        streamed = s.get_final_response()
    client.responses.create(
        model="any", input=[{"type": "item_reference", "id": i.id} for i in streamed.output], tools=tools
    )
    client.responses.create(model="any", input=[{"type": "item_reference", "id": call.id}], tools=tools)
    unstored = client.responses.create(model="any", input="Weather?", tools=tools, store=False)
    for ref in ("rs_nope", unstored.output[0].id):
        with pytest.raises(openai.BadRequestError, match="is not known") as e:
            client.responses.create(model="any", input=[{"type": "item_reference", "id": ref}])
        assert e.value.body["param"] == "input[0]"


def test_previous_response_id_continues_the_conversation(scripted):
    """previous_response_id: the prompt is the one the whole conversation sent as input gives (the chain's
    input and output items, streamed responses' too; instructions not carried over); GET returns a kept
    response as it was, input_items its own input (pages, both orders), DELETE drops it, and a chain
    through a dropped, unknown or store-false response is a 400 naming previous_response_id."""
    llm, client = scripted
    tools = [TOOL]
    first = client.responses.create(model="any", input="Weather?", tools=tools, instructions="Be brief.")
    calls = [o for o in first.output if o.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
    second = client.responses.create(model="any", input=outputs, tools=tools, previous_response_id=first.id)
    chained = llm.tokenizer.decode(llm.prompts[-1])
    whole = [
        {"role": "user", "content": "Weather?"},
        *(o.model_dump(exclude_none=True) for o in first.output),
    ]
    client.responses.create(model="any", input=whole + outputs, tools=tools)
    assert chained == llm.tokenizer.decode(llm.prompts[-1]) and "Be brief." not in chained
    assert second.previous_response_id == first.id and first.previous_response_id is None
    # a third turn, streamed, over the two before it; then one more from the streamed response
    with client.responses.stream(model="any", input="And Oslo?", previous_response_id=second.id) as s:
        third = s.get_final_response()
    whole += outputs + [o.model_dump(exclude_none=True) for o in second.output]
    whole.append({"role": "user", "content": "And Oslo?"})
    client.responses.create(model="any", input=whole)
    assert llm.tokenizer.decode(llm.prompts[-2]) == llm.tokenizer.decode(llm.prompts[-1])
    client.responses.create(model="any", input="Thanks", previous_response_id=third.id)
    whole += [o.model_dump(exclude_none=True) for o in third.output] + [{"role": "user", "content": "Thanks"}]
    client.responses.create(model="any", input=whole)
    assert llm.tokenizer.decode(llm.prompts[-2]) == llm.tokenizer.decode(llm.prompts[-1])

    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    kept = client.responses.retrieve(third.id)  # (the stream helper's objects are parsed ones)
    assert [o.id for o in kept.output] == [
        o.id for o in third.output
    ] and kept.output_text == third.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.call_id for i in items.data] == [c.call_id for c in reversed(calls)]  # newest first
    assert all(i.id for i in items.data) and not items.has_more
    page = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [i.call_id for i in page.data] == [calls[0].call_id] and page.has_more
    assert [i.call_id for p in page.iter_pages() for i in p.data] == [c.call_id for c in calls]
    (text,) = client.responses.input_items.list(third.id).data
    assert text.role == "user" and text.content[0].text == "And Oslo?"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(second.id, limit=0)
    assert e.value.body["param"] == "limit"

    # an error in the new input names the input's own item, not its place after the history
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="any", input=[{"role": "bogus", "content": "x"}], previous_response_id=third.id
        )
    assert e.value.body["param"] == "input[0]"

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    unstored = client.responses.create(model="any", input="Weather?", store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for rid, words in [
        (second.id, f"continues {first.id!r}, which is no longer kept"),
        (unstored.id, "is not kept"),
        ("resp_nope", "is not kept"),
    ]:
        with pytest.raises(openai.BadRequestError, match=words) as e:
            client.responses.create(model="any", input="hi", previous_response_id=rid)
        assert e.value.body["param"] == "previous_response_id"
        assert e.value.body["code"] == "previous_response_not_found"


def test_kept_input_items_are_the_apis_items(scripted):
    """GET .../input_items lists items the SDK's ResponseItem models take (string contents as parts, types,
    statuses and ids filled in, an id sent twice made unique so paging ends); the history renders them as
    the items sent; an item of previous_response_id's chain sent again is a 400, as in OpenAI's API."""
    from openai.types.responses import ResponseItem

    llm, client = scripted
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    sent = [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": "Checking.", "id": "same"},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny", "id": "same"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    ]
    first = client.responses.create(model="any", input=sent, tools=[TOOL])
    as_sent = llm.tokenizer.decode(llm.prompts[-1])
    raw = httpx.get(f"{client.base_url}responses/{first.id}/input_items", params={"order": "asc"}).json()
    items = [TypeAdapter(ResponseItem).validate_python(i) for i in raw["data"]]
    assert [i.type for i in items] == [
        "message",
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert items[1].content[0].text == "Checking." and items[0].content[0].text == "Weather?"
    assert len({i.id for i in items}) == 5 and items[2].id == "fc_1"
    paged = [i.id for i in client.responses.input_items.list(first.id, limit=2, order="asc")]
    assert paged == [i.id for i in items]  # every page, each item once
    client.responses.create(model="any", input="Go on", tools=[TOOL], previous_response_id=first.id)
    assert llm.tokenizer.decode(llm.prompts[-1]).startswith(as_sent.rsplit("<|im_start|>assistant", 1)[0])
    again = [{"type": "item_reference", "id": first.output[0].id}, {"role": "user", "content": "more"}]
    for dup, at in ((again, "input[0]"), ([{"role": "user", "content": "x"}, call], "input[1]")):
        with pytest.raises(openai.BadRequestError, match="Duplicate item found") as e:
            client.responses.create(model="any", input=dup, tools=[TOOL], previous_response_id=first.id)
        assert e.value.body["param"] == at


def test_input_tokens_count_what_a_response_reads(scripted):
    """POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count): the input_tokens a response
    to the same request reports, previous_response_id's conversation included; /v1/responses/compact is a
    404 that says it is not served (not a 405 for a response named "compact")."""
    _, client = scripted
    ask = dict(input="Weather?", tools=[TOOL], instructions="Be brief.")
    first = client.responses.create(model="any", **ask)
    assert client.responses.input_tokens.count(**ask).input_tokens == first.usage.input_tokens
    later = dict(input="And Oslo?", previous_response_id=first.id)
    counted = client.responses.input_tokens.count(**later).input_tokens
    assert counted == client.responses.create(model="any", **later).usage.input_tokens
    assert client.responses.input_tokens.count(previous_response_id=first.id).input_tokens < counted
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.post("/responses/compact", body={"input": "x"}, cast_to=dict)


def test_reasoning_effort_none_turns_thinking_off(scripted):
    """reasoning.effort "none" (OpenAI's no reasoning) is the template's enable_thinking false, as chat's
    chat_template_kwargs give it (which the Responses request takes too, vLLM's extension); other efforts
    leave the template's default."""
    llm, client = scripted

    def prompt(**kw) -> str:
        client.responses.create(model="any", input="hi", max_output_tokens=2, **kw)
        return llm.tokenizer.decode(llm.prompts[-1])

    default, off = prompt(), prompt(reasoning={"effort": "none"})
    echoed = client.responses.create(
        model="any", input="hi", max_output_tokens=2, reasoning={"effort": "none"}
    )
    assert echoed.reasoning.effort == "none"  # the request's, echoed as OpenAI's responses do
    assert off != default and off.endswith("<think>\n\n</think>\n\n")
    assert prompt(reasoning={"effort": "low"}) == default
    assert prompt(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == off
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}  # what the client set wins
    assert prompt(reasoning={"effort": "none"}, extra_body=kwargs) == default
    chat = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(
        model=_model(client),
        messages=chat,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert llm.tokenizer.decode(llm.prompts[-1]) == off


class _Gated(ScriptedLLM):
    """A scripted engine that waits for `gate` before each chunk after its first (a response in progress)."""

    gate: threading.Event | None = None

    def generate_stream(self, prompt, max_tokens=256, **kw):
        for i, chunk in enumerate(super().generate_stream(prompt, max_tokens, **kw)):
            if i and self.gate is not None:
                assert self.gate.wait(30)
            yield chunk


def _until(client, rid: str, statuses: tuple[str, ...]) -> Response:
    deadline = time.monotonic() + 30
    while (r := client.responses.retrieve(rid)).status not in statuses:
        assert time.monotonic() < deadline, r.status
        time.sleep(0.02)
    return r


def test_background_responses(tmp_path):
    """background: answered at once (queued), run without a client, read with GET (in_progress while the
    engine runs it, then the response a foreground request gives); POST .../cancel stops one in progress
    (cancelled; again: unchanged); a failure is kept as failed; continuing one not yet ended is a 400, as
    are background with store false or with stream, and cancelling a foreground response."""
    llm = _Gated.with_test_tokenizer(tmp_path, THINK + XML_CALL)
    with serve_in_thread(llm) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        ask = dict(model="any", input="Weather?", tools=[TOOL])
        foreground = client.responses.create(**ask)
        queued = client.responses.create(**ask, background=True)
        assert queued.status == "queued" and queued.background and queued.output == []
        done = _until(client, queued.id, ("completed",))
        assert [o.type for o in done.output] == [o.type for o in foreground.output]
        assert done.output_text == foreground.output_text and done.usage == foreground.usage
        assert client.responses.cancel(queued.id).status == "completed"  # ended: as it is

        llm.gate = threading.Event()
        running = client.responses.create(**ask, background=True)
        _until(client, running.id, ("in_progress",))
        with pytest.raises(openai.BadRequestError, match="has not ended yet"):
            client.responses.create(model="any", input="more", previous_response_id=running.id)
        threading.Timer(0.3, llm.gate.set).start()  # the engine's current token ends, then it stops
        cancelled = client.responses.cancel(running.id)
        assert cancelled.status == "cancelled" and cancelled.usage.output_tokens >= 1  # what it generated
        assert cancelled.output and all(o.status == "incomplete" for o in cancelled.output)
        assert client.responses.retrieve(running.id).model_dump() == cancelled.model_dump()
        assert client.responses.cancel(running.id).status == "cancelled"

        llm.gate = threading.Event()
        dropped = client.responses.create(**ask, background=True)
        _until(client, dropped.id, ("in_progress",))
        threading.Timer(0.3, llm.gate.set).start()
        client.responses.delete(dropped.id)  # stopped, and not kept when it ends
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(dropped.id)

        # one waiting behind another in progress: cancelled at once, not when the engine reaches it
        llm.gate = threading.Event()
        first = client.responses.create(**ask, background=True)
        _until(client, first.id, ("in_progress",))
        waiting = client.responses.create(**ask, background=True)
        t0 = time.monotonic()
        assert client.responses.cancel(waiting.id).status == "cancelled" and time.monotonic() - t0 < 5
        assert client.responses.retrieve(first.id).status == "in_progress"
        llm.gate.set()
        assert _until(client, first.id, ("completed",)).output_text == foreground.output_text
        r = httpx.get(f"{url}/v1/responses/{first.id}", params={"stream": "true"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"

        llm.gate, llm.fail_after = None, 2
        failed = _until(client, client.responses.create(**ask, background=True).id, ("failed",))
        assert failed.error is not None
        llm.fail_after = None
        for extra in ({"store": False}, {"stream": True}):
            r = httpx.post(url + "/v1/responses", json={**ask, "background": True, **extra}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
        with pytest.raises(openai.BadRequestError, match="only a background response"):
            client.responses.cancel(foreground.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_nope")


def test_the_response_store_is_bounded():
    """ResponseStore keeps the newest responses within its count and byte bounds, least recently used
    out first; continuing a conversation uses its whole chain, so its first turn outlives later one-offs."""
    from lumo.server.errors import APIError
    from lumo.server.responses import ResponseStore

    def response(rid: str, parent: str | None = None, text: str = "x") -> dict:
        message = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "content": text}
        return {"id": rid, "previous_response_id": parent, "output": [message]}

    store = ResponseStore(max_responses=3, max_bytes=2000)
    user = {"type": "message", "role": "user", "content": "q"}
    store.keep(response("a"), [user])
    store.keep(response("b", "a"), [user])
    store.keep(response("one-off"), [user])
    q = [{"type": "input_text", "text": "q"}]  # (kept as the API lists input items)
    assert [i["content"] for i in store.history("b")] == [q, "x", q, "x"]  # a and b used again
    store.keep(response("c"), [user])  # evicts the least recently used: the one-off, not a
    with pytest.raises(APIError, match="'one-off' is not kept"):
        store.history("one-off")
    assert store.get("a")["id"] == "a" and store.input_items("b")[0]["id"].startswith("msg_")
    store.keep(response("d"), [user])  # now a goes, and b's chain with it
    with pytest.raises(APIError, match="continues 'a', which is no longer kept"):
        store.history("b")
    store.keep(response("big", text="x" * 3000), [user])  # over the whole bound: not kept
    with pytest.raises(APIError) as e:
        store.get("big")
    assert e.value.status == 404
    store.keep(response("mid", text="x" * 1500), [user])  # evicts down to the byte bound
    assert store.get("mid")["id"] == "mid" and store._bytes <= 2000
    pending = {**response("bg"), "status": "queued"}  # a background response not yet ended stays
    store.keep(pending, [user])
    for i in range(5):
        store.keep(response(f"r{i}"), [user])
    assert store.get("bg")["status"] == "queued" and len(store._kept) <= 3


def test_the_item_store_is_bounded():
    """ItemStore keeps the newest items within its count and byte bounds; an item bigger than the bound,
    a reference, or an item without a string id is not kept."""
    from lumo.server.errors import APIError
    from lumo.server.responses import ItemStore

    store = ItemStore(max_items=3, max_bytes=300)
    items = [{"type": "message", "id": f"msg_{i}", "content": "x" * 10} for i in range(5)]
    store.keep(items + [{"type": "item_reference", "id": "ref"}, {"id": 5}, "text"])
    assert store.resolve([{"type": "item_reference", "id": "msg_4"}]) == [items[4]]
    with pytest.raises(APIError, match="'msg_1' is not known"):
        store.resolve([{"type": "item_reference", "id": "msg_1"}])  # the oldest went first
    store.keep([{"type": "message", "id": "big", "content": "x" * 400}])  # over the whole bound: not kept
    store.keep([{"type": "message", "id": "mid", "content": "x" * 150}])  # evicts down to the byte bound
    assert store.resolve([{"type": "item_reference", "id": "mid"}])[0]["id"] == "mid"
    with pytest.raises(APIError, match="'big' is not known"):
        store.resolve([{"type": "item_reference", "id": "big"}])
    assert store._bytes <= 300 and len(store._items) <= 3


def test_an_assistant_refusal_in_the_history_is_its_text(scripted):
    """A `refusal` part (one of the API's own output parts) in an assistant message of the input is that
    message's text, as chat takes it (session 47: a 400 before, which would fail every later turn of a
    session whose history holds one)."""
    llm, client = scripted
    history = [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot"}]},
        {"role": "user", "content": "ok"},
    ]
    client.responses.create(model="any", input=history, max_output_tokens=4)
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert "I cannot" in prompt and prompt.index("hi") < prompt.index("I cannot") < prompt.rindex("ok")
