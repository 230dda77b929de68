"""Structured outputs over HTTP (the embedded model on the CPU, through the official client where it has
the field): OpenAI's response_format on chat, streamed and not, vLLM's structured_outputs and guided_*
fields on completions, the Responses API's text.format; each output equals LLM.generate's under the same
grammar (the chat endpoints' content without the whitespace JSON may start with), and follows it."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import httpx
import openai

from lumo import LLM
from lumo.server.testing import serve_in_thread

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served():
    llm = LLM(device="cpu")
    with serve_in_thread(llm) as url:
        yield llm, url


def _chat(url: str, content: str, **kw):
    """A chat completion of one user message through the official client."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    return client.chat.completions.create(
        model="lumo-tiny", messages=[{"role": "user", "content": content}], **kw
    )


def _chat_prompt(llm: LLM, content: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )


def test_chat_json_schema_equals_llm(served):
    llm, url = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = _chat(url, "Describe a person.", response_format=fmt, max_tokens=60, temperature=0)
    text = r.choices[0].message.content
    want = llm.generate(
        _chat_prompt(llm, "Describe a person."),
        max_tokens=60,
        temperature=0,
        structured_outputs={"json": PERSON},
    )
    assert text == want.text and r.choices[0].finish_reason == want.finish_reason  # blanks before it kept
    if want.finish_reason == "stop":
        assert set(json.loads(text)) == {"name", "age"}
    else:
        assert text.startswith('{"name":"')


def test_chat_json_object_streamed(served):
    llm, url = served
    fmt = {"type": "json_object"}
    stream = _chat(
        url, "Some JSON please.", response_format=fmt, max_tokens=40, temperature=0.7, seed=5, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    want = llm.generate(
        _chat_prompt(llm, "Some JSON please."),
        max_tokens=40,
        temperature=0.7,
        seed=5,
        structured_outputs={"json_object": True},
    )
    assert text == want.text and text.lstrip().startswith("{")  # up to two blanks may come first


@pytest.mark.parametrize(
    "extra,check",
    [
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        (
            {"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}},
            lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t),
        ),
        ({"guided_regex": "(yes|no), because [a-z ]{3,20}"}, lambda t: re.match("(yes|no), because ", t)),
        ({"guided_grammar": 'start: "x = " NUM\nNUM: /[0-9]+/'}, lambda t: re.fullmatch("x = [0-9]+", t)),
    ],
    ids=["choice", "structured-regex", "regex", "grammar"],
)
def test_completions_vllm_fields(served, extra, check):
    llm, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.completions.create(
        model="lumo-tiny", prompt="The answer:", max_tokens=24, temperature=0, extra_body=extra
    )
    text = r.choices[0].text
    key, value = next(iter(extra.items()))
    form = {"guided_choice": "choice", "guided_regex": "regex", "guided_grammar": "grammar"}.get(key)
    so = value if form is None else {form: value}
    want = llm.generate("The answer:", max_tokens=24, temperature=0, structured_outputs=so)
    assert text == want.text
    assert check(text) or r.choices[0].finish_reason == "length"


def test_responses_text_format(served):
    llm, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.responses.create(
        model="lumo-tiny",
        input="Describe a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    want = llm.generate(
        _chat_prompt(llm, "Describe a person."),
        max_tokens=60,
        temperature=0,
        structured_outputs={"json": PERSON},
    )
    assert r.output_text == want.text


@pytest.mark.parametrize(
    "path,body,param,words",
    [
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
            "invalid structured output",
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "(("}}, "structured_outputs", "invalid"),
        ("/v1/completions", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            "/v1/completions",
            {"structured_outputs": {"structural_tag": "t"}},
            "structured_outputs",
            "not supported",
        ),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        ("/v1/chat/completions", {"guided_choice": ["a", "b"], "min_tokens": 2}, "min_tokens", "combined"),
        (
            "/v1/responses",
            {"text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
            "text",
            "invalid",
        ),
        # session 38: grammars that allow nothing, and a non-object x-guidance, are 400s before generating
        ("/v1/completions", {"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "no token"),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "<tool_call>"}},
            "structured_outputs",
            "no token",
        ),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"x-guidance": [1]}},
                }
            },
            "response_format",
            "x-guidance",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x-guidance": "a"}}}],
                "tool_choice": "required",
            },
            "tools",
            "x-guidance",
        ),
    ],
)
def test_bad_structured_requests(served, path, body, param, words):
    _, url = served
    base = {
        "/v1/completions": {"prompt": "a"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}]},
    }
    payload = {**base.get(path, {"input": "a"}), "max_tokens": 4, **body}
    if path == "/v1/responses":
        payload.pop("max_tokens")
    r = httpx.post(url + path, json=payload, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "\n" not in err["message"]


def test_text_response_format_beside_a_vllm_field(served):
    """response_format text asks for nothing (clients send it by default): beside guided_choice the choice
    applies; vLLM's fields reach the Responses API as extras."""
    llm, url = served
    choice = {"guided_choice": ["red", "green"]}
    r = _chat(url, "Colour?", response_format={"type": "text"}, extra_body=choice, max_tokens=8)
    assert r.choices[0].message.content in ("red", "green")
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.responses.create(
        model="lumo-tiny",
        input="Colour?",
        max_output_tokens=8,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert r.output_text in ("red", "green")


def test_grammars_that_fail_while_generating_are_400s(served):
    """A schema with no finite match passes the compile check (its first token is fine) and fails while
    generating: a 400 with llguidance's reason, or an error event in a stream, and the server goes on."""
    _, url = served
    endless = {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}
    }
    body = {
        "prompt": "a",
        "max_tokens": 200,
        "structured_outputs": {"json": {**endless, "$ref": "#/$defs/n"}},
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and "structured output" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]"), r.text
    ok = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_many_choices(served):
    """A choice of 3000 strings (one regular expression, not 3000 grammar rules: llguidance's parser takes
    2000 items in a row) answers one of them."""
    _, url = served
    choices = [f"opt{i}" for i in range(3000)]
    body = {"prompt": "a", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": choices}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices, r.text


def test_user_text_spelling_think_leaves_the_grammar_on(served):
    """A user's message that holds `<think>` (encoded as the token) does not turn the grammar off: only the
    prompt's last turn says whether the model is thinking."""
    llm, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.chat.completions.create(
        model="lumo-tiny",
        messages=[{"role": "user", "content": "say <think>"}],
        max_tokens=12,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no"), r
