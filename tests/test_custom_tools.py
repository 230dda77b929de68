"""OpenAI's custom (free-form) tools in the chat and Responses APIs: a tool whose input is text, optionally
matching a Lark grammar or a regular expression (Codex CLI's `apply_patch` is one). The model is shown a
function of one string parameter (protocol.custom_function); toolparse turns that parameter back into the
call's input text, streamed and the same in any split; a forced call follows the tool's grammar
(chat.forced_tool_calls). Over HTTP through the official client: a scripted engine for the output shapes,
the embedded model for the forced grammar."""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import httpx
import openai
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from lumo import LLM
from lumo.engine.llm import embedded_model_path
from lumo.server.chat import forced_tool_calls
from lumo.server.protocol import ChatCompletionRequest
from lumo.server.testing import TemplateForm, embedded_grammars, scripted_server, serve_in_thread
from lumo.server.toolparse import ChatOutputParser, ParsedDelta
from lumo.tokenizer import Tokenizer

# A patch envelope in Lark (written for these tests; Codex's own grammar has the same outline)
PATCH_GRAMMAR = r"""start: "*** Begin Patch" LF hunk+ "*** End Patch" LF?
hunk: add | delete
add: "*** Add File: " PATH LF plus+
delete: "*** Delete File: " PATH LF
plus: "+" /[^\n]*/ LF
PATH: /[^\n]+/
%import common.LF"""
PATCH = '*** Begin Patch\n*** Add File: a.txt\n+say "hi" \\ there\n+\ttab, 😀\n*** End Patch'
CHAT_TOOL = {
    "type": "custom",
    "custom": {
        "name": "apply_patch",
        "description": "Edit files with a patch.",
        "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": PATCH_GRAMMAR}},
    },
}
RESPONSES_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _xml(value: str) -> str:
    """A call of apply_patch in the XML form, `value` its input."""
    call = f"<function=apply_patch>\n<parameter=input>\n{value}\n</parameter>\n</function>"
    return f"<tool_call>\n{call}\n</tool_call>"


XML_CALL = _xml(PATCH)
WEATHER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
)
OUTPUT = "Editing." + XML_CALL + "\n" + WEATHER_CALL
USER = [{"role": "user", "content": "Add a.txt"}]


def _request(**kw) -> ChatCompletionRequest:
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [CHAT_TOOL, WEATHER], **kw})
    req.check_supported()
    return req


def _parsed(text: str, cuts: list[int] | None = None) -> ParsedDelta:
    req = _request()
    parser = ChatOutputParser(tools=req.template_tools(), custom=req.custom_tools())
    out, at = ParsedDelta(), 0
    for cut in [*(cuts or []), len(text)]:
        out.extend(parser.feed(text[at:cut]))
        at = cut
    out.extend(parser.finish())
    return out


def test_a_custom_call_carries_its_input_text_in_any_split():
    """The XML call's one parameter is the call's input, as written (quotes, backslashes, tabs, emoji);
    every split of the output gives the same calls, and the custom call's streamed pieces add up to it."""
    whole = _parsed(OUTPUT)
    calls = whole.calls()
    assert [(c.name, c.custom) for c in calls] == [("apply_patch", True), ("get_weather", False)]
    assert calls[0].arguments == PATCH and json.loads(calls[1].arguments) == {"city": "Oslo"}
    assert whole.content == "Editing."
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), rng.randint(1, 40)))
        split = _parsed(OUTPUT, cuts)
        assert [(c.name, c.arguments, c.custom) for c in split.calls()] == [
            (c.name, c.arguments, c.custom) for c in calls
        ]
        pieces = [p for p in split.tool_calls if p.index == 0]
        assert all(p.custom for p in pieces) and "".join(p.arguments for p in pieces) == PATCH
    parser = ChatOutputParser(tools=_request().template_tools(), custom=["apply_patch"])
    fed = [parser.feed(c).tool_calls for c in OUTPUT]  # a character at a time: pieces as it comes
    assert sum(any(p.index == 0 and p.arguments for p in d) for d in fed) > len(PATCH) // 2


@pytest.mark.parametrize(
    "body,expected",
    [
        (json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}), PATCH),  # the JSON form
        (json.dumps({"name": "apply_patch", "arguments": {"patch": "x"}}), "x"),  # one string, any name
        (json.dumps({"name": "apply_patch", "arguments": {}}), ""),
        (json.dumps({"name": "apply_patch", "arguments": {"input": 3}}), '{"input": 3}'),  # kept as JSON
        (
            "<function=apply_patch>\n<parameter=input>\nab\n</parameter>\n<parameter=x>\n1\n</parameter>\n</function>",
            "ab",
        ),
    ],
    ids=["json", "other-name", "empty", "not-text", "second-parameter"],
)
def test_other_call_shapes(body, expected):
    """A JSON-form call; arguments of another shape: a lone string whatever its name, none (empty text),
    anything else as its JSON text; a parameter after `input` is ignored. Inside the reasoning too."""
    for text in (
        f"<tool_call>\n{body}\n</tool_call>",
        f"<think>\nR<tool_call>\n{body}\n</tool_call>\n</think>",
    ):
        (call,) = _parsed(text).calls()
        assert call.custom and call.arguments == expected


def test_requests_and_the_template_view():
    """A custom tool is shown as a function of one string parameter whose description carries the grammar;
    a custom call in the history is that function's call with its input."""
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "custom", "custom": {"name": "apply_patch", "input": PATCH}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "applied"},
            ],
            "tools": [CHAT_TOOL],
            "tool_choice": {"type": "custom", "custom": {"name": "apply_patch"}},
        }
    )
    req.check_supported()
    fn = req.template_tools()[0]["function"]
    assert fn["name"] == "apply_patch" and fn["description"] == "Edit files with a patch."
    assert list(fn["parameters"]["properties"]) == ["input"] and fn["parameters"]["required"] == ["input"]
    assert PATCH_GRAMMAR in fn["parameters"]["properties"]["input"]["description"]
    assert req.messages[1].tool_calls[0].function.arguments == {"input": PATCH}
    assert req.custom_tools() == ["apply_patch"] and req.tool_choice.function == {"name": "apply_patch"}


def _takes(form: str, tool: dict, text: str) -> bool:
    """The grammar tool_choice "required" forces over [tool] takes `text` whole."""
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [tool], "tool_choice": "required"})
    con = embedded_grammars().constraint(forced_tool_calls(TemplateForm(form), req), ())
    try:
        con.advance(Tokenizer.from_dir(embedded_model_path()).encode(text))
    except RuntimeError:
        return False
    return con.matcher.is_accepting()


def _custom(fmt: dict) -> dict:
    return {"type": "custom", "custom": {"name": "apply_patch", "format": fmt}}


def _json(value: str) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": "apply_patch", "arguments": {"input": value}})
        + "\n</tool_call>"
    )


def test_a_forced_custom_call_follows_the_tools_grammar():
    """XML form: the input text follows the Lark grammar or the regular expression (slashes in it are
    literal); a text format takes any input. JSON form: a regular expression is the string's pattern,
    whole; a Lark grammar leaves the string free; the call's shape is enforced in both."""
    lark, text = CHAT_TOOL, _custom({"type": "text"})
    regex = _custom({"type": "grammar", "grammar": {"syntax": "regex", "definition": r"(yes|no)/[0-9]{2}"}})
    assert _takes("xml", lark, _xml(PATCH)) and _takes("xml", lark, _xml(PATCH + "\n"))
    assert not _takes("xml", lark, _xml("*** Begin Patch\nfree text\n*** End Patch"))
    assert not _takes("xml", lark, _xml(PATCH.replace("*** End Patch", "")))
    assert _takes("xml", regex, _xml("yes/42")) and not _takes("xml", regex, _xml("yes/421"))
    assert not _takes("xml", regex, _xml("maybe/42"))
    assert _takes("xml", text, _xml("anything at all"))
    # a greedy expression ends where the value does (a lexeme with the end as its suffix)
    for definition, value in ((r"[^/]+", "ab"), (r"[\s\S]*", "a\nb"), (r"a\/b|[/]x", "/x")):
        fmt = {"type": "grammar", "grammar": {"syntax": "regex", "definition": definition}}
        assert _takes("xml", _custom(fmt), _xml(value)), definition
    assert _takes("json", regex, _json("no/07")) and not _takes("json", regex, _json("xno/07"))
    assert _takes("json", lark, _json("not a patch"))
    assert not _takes(
        "json",
        lark,
        "<tool_call>\n" + json.dumps({"name": "apply_patch", "arguments": {"x": "1"}}) + "\n</tool_call>",
    )


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    with scripted_server(tmp_path_factory.mktemp("tok"), OUTPUT) as (llm, url):
        yield llm, url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_chat_completions(scripted):
    """A custom call as `{"type": "custom", "custom": {"name", "input"}}` (the SDK's model), streamed as
    its input's pieces; a custom call and its result in the history reach the template."""
    llm, url, client = scripted
    r = client.chat.completions.create(model="scripted", messages=USER, tools=[CHAT_TOOL, WEATHER])
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Editing."
    custom, fn = r.choices[0].message.tool_calls
    assert custom.type == "custom" and custom.custom.name == "apply_patch" and custom.custom.input == PATCH
    assert fn.type == "function" and json.loads(fn.function.arguments) == {"city": "Oslo"}
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert "apply_patch" in prompt and '"input"' in prompt  # the function the model is shown

    chunks = _sse(url, "/v1/chat/completions", {"messages": USER, "tools": [CHAT_TOOL, WEATHER]})
    deltas = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    first = next(t for t in deltas if t["index"] == 0)
    assert (
        first["type"] == "custom"
        and first["custom"]["name"] == "apply_patch"
        and first["id"].startswith("call_")
    )
    assert "".join(t["custom"]["input"] for t in deltas if t["index"] == 0) == PATCH
    assert all("function" not in t for t in deltas if t["index"] == 0)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"

    history = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "custom", "custom": {"name": "apply_patch", "input": PATCH}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "applied fine"},
    ]
    client.chat.completions.create(model="scripted", messages=history, tools=[CHAT_TOOL])
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert prompt.index('say \\"hi\\"') < prompt.index("applied fine")  # the call's input, then its result


EVENT = TypeAdapter(ResponseStreamEvent)


def test_responses(scripted):
    """A `custom_tool_call` output item (input, call_id); streamed as custom_tool_call_input deltas and
    done, every event an SDK model; custom_tool_call / custom_tool_call_output input items render."""
    llm, url, client = scripted
    r = client.responses.create(
        model="scripted",
        input="Add a.txt",
        tools=[RESPONSES_TOOL, WEATHER["function"] | {"type": "function"}],
    )
    assert [o.type for o in r.output] == ["message", "custom_tool_call", "function_call"]
    call = r.output[1]
    assert call.input == PATCH and call.name == "apply_patch" and call.call_id.startswith("call_")
    assert call.id.startswith("ctc_")

    events = _sse(url, "/v1/responses", {"input": "Add a.txt", "tools": [RESPONSES_TOOL]})
    for e in events:
        EVENT.validate_python(e)
        if "response" in e:
            Response.model_validate(e["response"])
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    (done,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == PATCH == done["input"] and done["output_index"] == 1
    assert kinds.index("response.custom_tool_call_input.done") < len(kinds) - 2
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["output"][1]["input"] == PATCH

    history = [
        {"role": "user", "content": "Add a.txt"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "applied fine"},
    ]
    client.responses.create(model="scripted", input=history, tools=[RESPONSES_TOOL])
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert prompt.index("Add a.txt") < prompt.index("a.txt\\n+say") < prompt.index("applied fine")


@pytest.mark.parametrize(
    "tools,choice,status,param,words",
    [
        ([{"type": "custom", "custom": {"description": "no name"}}], None, 422, "tools", "name"),
        ([_custom({"type": "grammar"})], None, 422, "tools", "grammar"),
        (
            [_custom({"type": "grammar", "grammar": {"syntax": "ebnf", "definition": "x"}})],
            None,
            422,
            "tools",
            "syntax",
        ),
        (
            [CHAT_TOOL, {"type": "function", "function": {"name": "apply_patch"}}],
            None,
            400,
            "tools[1]",
            "twice",
        ),
        (
            [WEATHER],
            {"type": "custom", "custom": {"name": "get_weather"}},
            400,
            "tool_choice",
            "function tool as custom",
        ),
        (
            [CHAT_TOOL],
            {"type": "function", "function": {"name": "apply_patch"}},
            400,
            "tool_choice",
            "custom tool as function",
        ),
        ([CHAT_TOOL], {"type": "custom", "custom": {}}, 422, "tool_choice", "tool_choice"),
    ],
    ids=[
        "no-name",
        "grammar-missing",
        "bad-syntax",
        "duplicate",
        "function-as-custom",
        "custom-as-function",
        "no-choice-name",
    ],
)
def test_bad_requests(scripted, tools, choice, status, param, words):
    """Malformed custom tools and choices: a 422 (schema validation) or 400 naming the field."""
    _, _, client = scripted
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.APIStatusError, match=words) as e:
        client.chat.completions.create(model="scripted", messages=USER, tools=tools, **kw)
    assert e.value.status_code == status and e.value.body["param"].startswith(param)


@pytest.fixture(scope="module")
def served():
    """The embedded model with a template that teaches the XML call form (its own teaches JSON)."""
    template = (
        "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nCall one as <tool_call>\n"
        "<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "{%- endif %}"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    with (
        serve_in_thread(LLM(device="cpu", chat_template=template)) as xml_url,
        serve_in_thread(LLM(device="cpu")) as json_url,
    ):
        yield xml_url, json_url


LABEL_REGEX = r"(yes|no)-[0-9]{2}"
LABEL_LARK = 'start: ANSWER "=" DIGIT DIGIT\nANSWER: "yes" | "no"\nDIGIT: /[0-9]/'


@pytest.mark.parametrize("syntax", ["regex", "lark"])
def test_the_embedded_model_calls_a_forced_custom_tool(served, syntax):
    """Greedy and sampled, a named custom tool_choice makes the embedded model call the tool with an input
    its grammar takes: the XML form for both syntaxes, the JSON form (the model's own template) for the
    regular expression; through the Responses API too."""
    xml_url, json_url = served
    definition, pattern = (
        (LABEL_REGEX, LABEL_REGEX) if syntax == "regex" else (LABEL_LARK, r"(yes|no)=[0-9]{2}")
    )
    fmt = {"type": "grammar", "grammar": {"syntax": syntax, "definition": definition}}
    tool = {"type": "custom", "custom": {"name": "label", "format": fmt}}
    urls = [xml_url, json_url] if syntax == "regex" else [xml_url]
    for url in urls:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for temperature in (0.0, 0.9):
            r = client.chat.completions.create(
                model="lumo-tiny",
                messages=USER,
                tools=[tool],
                tool_choice={"type": "custom", "custom": {"name": "label"}},
                parallel_tool_calls=False,
                max_tokens=48,
                temperature=temperature,
                seed=3,
            )
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and call.type == "custom"
            assert re.fullmatch(pattern, call.custom.input), call.custom.input
        r = client.responses.create(
            model="lumo-tiny",
            input="Label it.",
            tools=[
                {
                    "type": "custom",
                    "name": "label",
                    "format": {"type": "grammar", "syntax": syntax, "definition": definition},
                }
            ],
            tool_choice={"type": "custom", "name": "label"},
            parallel_tool_calls=False,
            max_output_tokens=48,
            temperature=0,
        )
        (call,) = [o for o in r.output if o.type == "custom_tool_call"]
        assert re.fullmatch(pattern, call.input), call.input


def test_an_invalid_forced_grammar_is_a_400(served):
    xml_url, _ = served
    client = openai.OpenAI(base_url=xml_url + "/v1", api_key="x", max_retries=0)
    tool = _custom({"type": "grammar", "grammar": {"syntax": "lark", "definition": "start: undefined_rule"}})
    with pytest.raises(openai.BadRequestError, match="invalid structured output") as e:
        client.chat.completions.create(model="lumo-tiny", messages=USER, tools=[tool], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


def test_a_codex_shaped_request(scripted):
    """A request shaped as Codex CLI sends one through `wire_api = "responses"` (its fields as documented in
    its source: developer instructions, function tools with `strict`, the free-form `apply_patch`, reasoning
    and store settings, `include`, a cache key, a previous turn's reasoning summary, custom and function calls
    with their outputs): served, streamed, its events the SDK's models, the patch call back as an item.
    Before session 44 it was a 400 twice over: the custom tool, and the developer message after the
    instructions, a second system message the family's templates refuse."""
    llm, url, _ = scripted
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        },
    }
    body = {
        "model": "scripted",
        "instructions": "You are a coding agent.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<env>linux</env>"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a.txt"}]},
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "Use a patch."}],
                "content": None,
                "encrypted_content": None,
            },
            {
                "type": "custom_tool_call",
                "id": "ctc_0",
                "status": "completed",
                "call_id": "call_0",
                "name": "apply_patch",
                "input": PATCH,
            },
            {"type": "custom_tool_call_output", "call_id": "call_0", "output": "Success. Updated a.txt"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "shell",
                "arguments": '{"command": ["ls"]}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        ],
        "tools": [shell, RESPONSES_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
        "text": {"verbosity": "medium"},
    }
    events = _sse(url, "/v1/responses", body)
    for e in events:
        EVENT.validate_python(e)
    assert events[-1]["type"] == "response.completed"
    assert [o["type"] for o in events[-1]["response"]["output"]] == [
        "message",
        "custom_tool_call",
        "function_call",
    ]
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    # the instructions and the developer message: one system message (the template takes one, first)
    assert prompt.index("You are a coding agent.\n\n<env>linux</env>") < prompt.index("Add a.txt")
    assert prompt.index("Use a patch.") < prompt.index("Success. Updated a.txt") < prompt.index('"ls"')


def test_what_an_agents_history_holds_is_served(scripted):
    """What a text model cannot use is left out rather than refused (a refused item in an agent's history
    would fail every later turn): a hosted tool (Codex CLI sends web_search by default) and its calls, an
    image (a note in its place); a developer message mid-conversation is a user message (the templates take
    a system message only first); text parts one per line; any model name."""
    llm, url, _ = scripted
    body = {
        "model": "gpt-5-codex",
        "tools": [{"type": "web_search", "external_web_access": False}, RESPONSES_TOOL],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_image"}]},
            {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": "q"}},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Seen."}]},
            {"role": "developer", "content": [{"type": "input_text", "text": "<mode>plan</mode>"}]},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
        ],
    }
    events = _sse(url, "/v1/responses", body)
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["model"] == "scripted"
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert "Look:\n[an image was left out: this model reads text only]" in prompt
    assert prompt.index("Seen.") < prompt.index("<mode>plan</mode>") < prompt.index("a\nb")
    assert "web_search" not in prompt and "apply_patch" in prompt
    # history items of other hosted tools are left out too; an error names the request's own tool index
    mcp = [{"type": t, "id": "x"} for t in ("mcp_list_tools", "mcp_approval_request", "tool_search_call")]
    assert (
        _sse(url, "/v1/responses", {**body, "input": [*body["input"], *mcp]})[-1]["type"]
        == "response.completed"
    )
    twice = [{"type": "web_search"}, RESPONSES_TOOL, {"type": "function", "name": "apply_patch"}]
    r = httpx.post(url + "/v1/responses", json={"input": "a", "tools": twice}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[2]"


def test_a_conversation_past_the_context_fails_in_the_stream(tmp_path):
    """Streamed, a conversation longer than the context is response.failed with code
    context_length_exceeded (Codex CLI compacts on that), not an HTTP 400; unstreamed it is the 400."""
    with scripted_server(tmp_path, "x", max_model_len=32) as (_, url):
        body = {"model": "scripted", "input": "word " * 200}
        events = _sse(url, "/v1/responses", body)
        assert [e["type"] for e in events] == ["response.created", "error", "response.failed"]
        failed = events[-1]["response"]
        # the SDK's ResponseError lists no context_length_exceeded (Codex CLI's source reads it there):
        # the events' shapes are checked with another code in its place
        for e in events:
            EVENT.validate_python(
                json.loads(json.dumps(e).replace("context_length_exceeded", "server_error"))
            )
        assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # max_output_tokens past the context: the request's own mistake, a 400 streamed or not
        body = {"model": "scripted", "input": "hi", "max_output_tokens": 1000, "stream": True}
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_escaped_input_in_any_split():
    """The input's JSON escapes (surrogate pairs, lone halves, a high half before another) decode the same
    whatever the split of the arguments' text (the XML form never escapes them; a JSON-form call could)."""
    from lumo.server.toolparse import _CustomInput

    pieces = ["\\ud83d", "\\ude00", "\\udfff", "\\ud800", "a", "\\n", '\\"', "\\\\", "é", "\\u00e9", "\\t"]
    rng = random.Random(7)
    for _ in range(3000):
        text = '{"input": "' + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))) + '"}'
        whole = _CustomInput().feed(text, final=True)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        reader, out, at = _CustomInput(), "", 0
        for cut in [*cuts, len(text)]:
            out += reader.feed(text[at:cut], final=cut == len(text))
            at = cut
        assert out == whole == json.loads(text)["input"], text


def test_namespace_tools(tmp_path):
    """A namespace's tools (Codex CLI groups its sub-agent tools so) are tools of their own, shown under
    their own names (`NAMESPACE__NAME` where another tool has the name too); a call of one is a
    function_call item carrying the namespace, and such an item in the history is that tool's call."""
    close = {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}
    spawn = {"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}}
    agents = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [close, spawn]}
    call = "<tool_call>\n<function=close_agent>\n</function>\n</tool_call>"
    call += "<tool_call>\n<function=agents__spawn>\n</function>\n</tool_call>"
    with scripted_server(tmp_path, call) as (llm, url):
        events = _sse(url, "/v1/responses", {"input": "Close it.", "tools": [agents, spawn]})
        for e in events:
            EVENT.validate_python(e)
        calls = events[-1]["response"]["output"]
        assert [(c["name"], c.get("namespace")) for c in calls] == [
            ("close_agent", "agents"),
            ("spawn", "agents"),
        ]
        prompt = llm.tokenizer.decode(llm.prompts[-1])
        assert '"close_agent"' in prompt and '"agents__spawn"' in prompt and '"spawn"' in prompt
        history = [
            {"role": "user", "content": "Close it."},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "spawn",
                "namespace": "agents",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
        ]
        _sse(url, "/v1/responses", {"input": history, "tools": [agents, spawn]})
        prompt = llm.tokenizer.decode(llm.prompts[-1])
        assert prompt.index('"name": "agents__spawn"') < prompt.index("spawned")
        # malformed namespaces and names: 400s naming the tool or item, not 500s
        bad_item = {**history[1], "namespace": ["agents"]}
        cases = [
            (
                {"tools": [{"type": "namespace", "name": "ns", "tools": ["x"]}]},
                "tools[0]",
                "must be an object",
            ),
            ({"tools": [{"type": "function", "name": ["a"]}]}, "tools[0]", "needs a name"),
            ({"tools": [agents, spawn, {**spawn, "name": "agents__spawn"}]}, "tools[2]", "used twice"),
            ({"tools": [agents, agents]}, "tools[1]", "used twice"),
            ({"input": [history[0], bad_item], "tools": [agents]}, "input[1]", "namespace must be a string"),
        ]
        for body, param, words in cases:
            r = httpx.post(url + "/v1/responses", json={"input": "hi", **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert words in r.json()["error"]["message"]
