"""Malformed bodies a fuzzer of the HTTP APIs found to give 500s, broken streams or invalid JSON (session
44, a helper's seeded mutation of valid requests, a few thousand per endpoint): each is now a 4xx with a
JSON error. Minimised bodies, sent as raw JSON text (lone surrogates and -Infinity included)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import httpx

from lumo.server.chat import forced_tool_calls
from lumo.server.protocol import ChatCompletionRequest
from lumo.server.testing import TemplateForm, scripted_server

CASES = [
    ("/v1/responses", '{"input": [{"type": {}}]}', "input[0]"),
    ("/v1/responses", '{"input": [{"role": "user", "content": [{"type": {}}]}]}', "input[0].content[0]"),
    ("/v1/responses", '{"input": "x", "tools": [{"type": {}}]}', "tools[0]"),
    (
        "/v1/responses",
        '{"input": "x", "tools": [{"type": "function", "name": "s", "parameters": {"a": -Infinity}}]}',
        "tools",
    ),
    ("/v1/responses", '{"input": "x", "text": {"format": {"name": "\\ud800"}}}', "text"),
    ("/v1/responses", '{"input": "x", "metadata": {"k": "\\udc00"}, "stream": true}', "metadata"),
    (
        "/v1/messages",
        '{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": []}]}]}',
        None,
    ),
    (
        "/v1/messages/count_tokens",
        '{"model": "m", "messages": [{"role": "user", "content": '
        '[{"type": "tool_result", "content": [{"type": {}}]}]}]}',
        None,
    ),
]


def test_malformed_bodies_are_4xx_json_errors(tmp_path):
    with scripted_server(tmp_path, "Hi.") as (_, url):
        for path, body, param in CASES:
            r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            error = r.json()["error"]
            assert param is None or error["param"] == param, (body, error)


def test_a_malformed_required_list_in_a_forced_xml_call():
    """`required` holding a list (unhashable) or not a list: ignored, not a TypeError."""
    for required in ([[]], 5, "x"):
        tool = {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"a": {}}, "required": required}},
        }
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"}
        )
        assert forced_tool_calls(TemplateForm("xml"), req).grammar
