"""Bad requests get OpenAI-shaped JSON errors (400/404/422/503) and the server stays up.

One `lumo serve` subprocess (tiny checkpoint without a reachable end-of-sequence token, CPU,
--max-queue 1) for the whole file; it also checks that a client hanging up mid-stream frees the engine.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import asyncio
import json
import re
import time
from typing import Any

import httpx
import openai

from lumo.server.testing import ScriptedLLM, serve_subprocess
from lumo.server.worker import Job
from lumo.testing import make_tiny_checkpoint

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4, mtp_num_hidden_layers=0)
    # An end-of-sequence id outside the vocabulary can never be sampled: every generation runs to
    # max_tokens, so the long requests below really are long.
    gen_cfg = json.loads((ckpt / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [10**6]
    (ckpt / "generation_config.json").write_text(json.dumps(gen_cfg))
    with serve_subprocess(ckpt, "--device", "cpu", "--max-queue", "1", env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def _check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    assert err["type"] == {503: "server_overloaded", 404: "not_found_error"}.get(
        status, "invalid_request_error"
    )
    if param is not None:
        assert err["param"] == param, err
    return err


BAD = [
    # (id, path, json body, status, param, words the message must contain)
    ("body-not-object", CHAT, [1, 2], 422, None, "JSON object"),
    ("missing-messages", CHAT, {"max_tokens": 3}, 422, "messages", "required"),
    ("messages-not-list", CHAT, {"messages": "hi"}, 422, "messages", ""),
    ("max-tokens-string", CHAT, {"messages": USER, "max_tokens": "abc"}, 422, "max_tokens", "integer"),
    ("max-tokens-negative", CHAT, {"messages": USER, "max_tokens": -5}, 422, "max_tokens", "greater than"),
    ("max-tokens-zero", COMP, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "echo"),
    ("max-tokens-zero-chat", CHAT, {"messages": USER, "max_tokens": 0}, 422, "max_tokens", ""),
    ("temperature-negative", CHAT, {"messages": USER, "temperature": -0.5}, 422, "temperature", ""),
    ("temperature-past-float32", COMP, {"prompt": "x", "temperature": 1e300}, 422, "temperature", ""),
    ("top-p-zero", COMP, {"prompt": "a", "top_p": 0}, 422, "top_p", ""),
    (
        "unknown-role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        422,
        "messages[0].role",
        "wizard",
    ),
    ("missing-prompt", COMP, {"max_tokens": 3}, 422, "prompt", ""),
    ("huge-max-tokens", CHAT, {"messages": USER, "max_tokens": 10**9}, 400, "max_tokens", "4096"),
    (
        "huge-max-completion-tokens",  # the field the request used is named
        CHAT,
        {"messages": USER, "max_completion_tokens": 10**6},
        400,
        "max_completion_tokens",
        "1000000 for max_completion_tokens",
    ),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages", "empty"),
    ("prompt-too-long", COMP, {"prompt": "hello world " * 3000}, 400, "prompt", "4096"),
    ("unknown-model", CHAT, {"model": "gpt-9", "messages": USER}, 404, "model", "gpt-9"),
    ("n-0", CHAT, {"messages": USER, "n": 0}, 422, "n", ""),
    ("n-too-many", CHAT, {"messages": USER, "n": 257}, 422, "n", ""),
    ("n-times-prompts", COMP, {"prompt": ["a"] * 200, "n": 2}, 400, "n", "256 choices"),
    ("presence-penalty-3", COMP, {"prompt": "a", "presence_penalty": 3}, 422, "presence_penalty", ""),
    ("freq-penalty-str", COMP, {"prompt": "a", "frequency_penalty": "x"}, 422, "frequency_penalty", ""),
    ("repetition-penalty-0", COMP, {"prompt": "a", "repetition_penalty": 0}, 422, "repetition_penalty", ""),
    ("min-p-2", CHAT, {"messages": USER, "min_p": 2}, 422, "min_p", ""),
    ("logit-bias-id", COMP, {"prompt": "a", "logit_bias": {"99999999": 10}}, 400, "logit_bias", "vocabulary"),
    ("logit-bias-key", CHAT, {"messages": USER, "logit_bias": {"the": 1}}, 400, "logit_bias", "token ids"),
    ("logit-bias-neg", COMP, {"prompt": "a", "logit_bias": {"-1": 1}}, 400, "logit_bias", "vocabulary"),
    ("logit-bias-value", COMP, {"prompt": "a", "logit_bias": {"5": "x"}}, 422, "logit_bias.5", "number"),
    ("logit-bias-list", CHAT, {"messages": USER, "logit_bias": [5]}, 422, "logit_bias", ""),
    # the request's field, not pydantic's name of a union member (`stop.str`); booleans are no token ids
    ("stop-int", COMP, {"prompt": "a", "stop": 5}, 422, "stop", ""),
    ("tool-choice-any", CHAT, {"messages": USER, "tool_choice": "any"}, 422, "tool_choice", ""),
    ("content-int", CHAT, {"messages": [{"role": "user", "content": 5}]}, 422, "messages[0].content", ""),
    ("prompt-bools", COMP, {"prompt": [True, False]}, 422, "prompt", ""),
    ("prompt-floats", COMP, {"prompt": [1.0, 2.0]}, 422, "prompt", ""),
    (
        "stop-ids-range",
        COMP,
        {"prompt": "a", "stop_token_ids": [-1]},
        400,
        "stop_token_ids",
        "vocabulary",
    ),
    ("stop-ids-str", CHAT, {"messages": USER, "stop_token_ids": ["a"]}, 422, "stop_token_ids[0]", "integer"),
    ("ignore-eos-str", COMP, {"prompt": "a", "ignore_eos": "yes"}, 422, "ignore_eos", ""),
    (
        "min-tokens-over",
        COMP,
        {"prompt": "a", "max_tokens": 3, "min_tokens": 4},
        400,
        "min_tokens",
        "exceeds",
    ),
    ("min-tokens-negative", CHAT, {"messages": USER, "min_tokens": -1}, 422, "min_tokens", ""),
    ("min-tokens-default-limit", COMP, {"prompt": "Hi", "min_tokens": 20}, 400, "min_tokens", "16 tokens"),
    ("min-tokens-streamed", COMP, {"prompt": "Hi", "min_tokens": 20, "stream": True}, 400, "min_tokens", ""),
    ("min-tokens-context", CHAT, {"messages": USER, "min_tokens": 5000}, 400, "min_tokens", "exceeds"),
    (
        "continue-and-open",
        CHAT,
        {"messages": USER, "continue_final_message": True, "add_generation_prompt": True},
        400,
        "continue_final_message",
        "both",
    ),
    ("tokenize-neither", "/tokenize", {}, 400, "messages", "prompt or messages"),
    ("tokenize-both", "/tokenize", {"prompt": "a", "messages": USER}, 400, "prompt", "prompt or messages"),
    ("tokenize-empty-chat", "/tokenize", {"messages": []}, 400, "messages", "empty"),
    ("detokenize-range", "/detokenize", {"tokens": [1, -4]}, 400, "tokens", "token ids"),
    ("detokenize-str", "/detokenize", {"tokens": "abc"}, 422, "tokens", ""),
    ("top-logprobs-alone", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (
        "top-logprobs-21",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 99},
        422,
        "top_logprobs",
        "",
    ),
    ("logprobs-negative", COMP, {"prompt": "a", "logprobs": -1}, 422, "logprobs", ""),
    ("logprobs-string", COMP, {"prompt": "a", "logprobs": "3"}, 422, "logprobs", ""),
    ("logprobs-true", COMP, {"prompt": "a", "logprobs": True}, 422, "logprobs", ""),
    ("logprobs-float", COMP, {"prompt": "a", "logprobs": 2.0}, 422, "logprobs", ""),
    # numbers and flags are not coerced from booleans or strings (OpenAI's API refuses them too)
    ("temperature-bool", CHAT, {"messages": USER, "temperature": True}, 422, "temperature", "number"),
    ("top-p-str", COMP, {"prompt": "a", "top_p": "0.5"}, 422, "top_p", "number"),
    ("n-bool", COMP, {"prompt": "a", "n": True}, 422, "n", "integer"),
    ("max-tokens-float", CHAT, {"messages": USER, "max_tokens": 5.5}, 422, "max_tokens", "integer"),
    ("seed-str", CHAT, {"messages": USER, "seed": "7"}, 422, "seed", "integer"),
    ("seed-over-int64", COMP, {"prompt": "a", "seed": 2**64}, 422, "seed", ""),
    ("seed-under-int64", CHAT, {"messages": USER, "seed": -(2**63) - 1}, 422, "seed", ""),
    ("stream-str", COMP, {"prompt": "a", "stream": "false"}, 422, "stream", "boolean"),
    ("bias-bool", CHAT, {"messages": USER, "logit_bias": {"5": True}}, 422, "logit_bias.5", "number"),
    ("chat-logprobs-string", CHAT, {"messages": USER, "logprobs": "yes"}, 422, "logprobs", ""),
    (
        "top-logprobs-str",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": "3"},
        422,
        "top_logprobs",
        "",
    ),
    (
        "response-format-type",
        CHAT,
        {"messages": USER, "response_format": {"type": "yaml"}},
        400,
        "response_format",
        "yaml",
    ),
    ("too-many-prompts", COMP, {"prompt": ["a"] * 257}, 400, "prompt", "257 prompts"),
    ("empty-prompt-in-batch", COMP, {"prompt": ["a", ""]}, 400, "prompt[1]", "empty"),
    ("long-prompt-in-batch", COMP, {"prompt": ["a", "hello world " * 3000]}, 400, "prompt[1]", "4096"),
    ("empty-prompt", COMP, {"prompt": ""}, 400, "prompt", "empty"),
    ("token-out-of-range", COMP, {"prompt": [1, 10**7]}, 400, "prompt", ""),
    (
        "unknown-part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "hologram", "hologram": {"url": "x"}}]}]},
        400,
        "messages[0].content[0]",
        "hologram",
    ),
    ("user-without-content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", ""),
    (
        "tool-choice-without-tools",
        CHAT,
        {"messages": USER, "tool_choice": "required"},
        400,
        "tool_choice",
        "",
    ),
    (
        "template-kwargs-clash",
        CHAT,
        {"messages": USER, "chat_template_kwargs": {"messages": 5}},
        400,
        "chat_template_kwargs",
        "may not set messages",
    ),
    ("beam-search", CHAT, {"messages": USER, "use_beam_search": True}, 400, "use_beam_search", "beam"),
    (
        "prompt-logprobs-stream",
        COMP,
        {"prompt": "x", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
        "stream",
    ),  # fmt: skip
    (
        "prompt-logprobs-all",
        CHAT,
        {"messages": USER, "prompt_logprobs": -1},
        400,
        "prompt_logprobs",
        "[0, 20]",
    ),
    ("prompt-logprobs-21", COMP, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "got 21"),
    ("prompt-logprobs-str", COMP, {"prompt": "x", "prompt_logprobs": "1"}, 422, "prompt_logprobs", ""),
    (
        "truncate-0",
        CHAT,
        {"messages": USER, "truncate_prompt_tokens": 0},
        400,
        "truncate_prompt_tokens",
        "-1",
    ),
    (
        "truncate-over-context",
        COMP,
        {"prompt": "x", "truncate_prompt_tokens": 10**6},
        400,
        "truncate_prompt_tokens",
        "exceeds this model's context",
    ),  # fmt: skip
    (
        "token-ids-str",
        COMP,
        {"prompt": "x", "return_tokens_as_token_ids": "yes"},
        422,
        "return_tokens_as_token_ids",
        "",
    ),
    ("chat-best-of", CHAT, {"messages": USER, "best_of": 3}, 400, "best_of", "only 1"),
    (
        "max-tokens-0",
        COMP,
        {"prompt": "x", "max_tokens": 0},
        400,
        "max_tokens",
        "echo=true or prompt_logprobs",
    ),
    (
        "max-tokens-0-stream",
        COMP,
        {"prompt": "x", "max_tokens": 0, "prompt_logprobs": 0, "stream": True},
        400,
        "max_tokens",
        "echo=true",
    ),  # fmt: skip
    ("chat-echo", CHAT, {"messages": USER, "echo": True}, 400, "echo", "not supported"),
    ("truncation-side", COMP, {"prompt": "x", "truncation_side": "middle"}, 422, "truncation_side", ""),
    ("functions", CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions", "use tools"),
    ("function-call", CHAT, {"messages": USER, "function_call": "auto"}, 400, "function_call", "use tools"),
    (
        "stream-options-no-stream",
        CHAT,
        {"messages": USER, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream: true",
    ),  # fmt: skip
    (
        "text-part-without-text",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages[0].content[0]",
        "needs `text`",
    ),  # fmt: skip
    (
        "responses-output-tokens",
        "/v1/responses",
        {"input": "hi", "max_output_tokens": 10**6},
        400,
        "max_output_tokens",
        "1000000 for max_output_tokens",
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request(server, case):
    _, path, body, status, param, words = case
    r = httpx.post(server.url + path, json=body, timeout=30)
    err = _check_error(r, status, param)
    assert words in err["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        (COMP, b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        (COMP, b'{"prompt": "a\\ud800b", "max_tokens": 2, "stream": true}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}'),
    ],
    ids=["completion", "stream", "chat"],
)
def test_lone_surrogate_is_a_400(server, path, body):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert "lone surrogate" in _check_error(r, 400)["message"]


@pytest.mark.parametrize("value", [b"Infinity", b"NaN"])
def test_a_temperature_that_is_not_a_finite_number_is_a_422(server, value):
    """Not JSON, but Python's json module reads them; with no upper bound on the temperature (vLLM's) the
    check that it is finite is what refuses them."""
    body = b'{"prompt": "x", "max_tokens": 2, "temperature": ' + value + b"}"
    r = httpx.post(server.url + COMP, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert "finite" in _check_error(r, 422, "temperature")["message"]


def test_huge_prompt_is_refused_without_tokenising(server):
    """Far more characters than the context could hold: a 400 at once (tokenising 20 MB took ~20 s)."""
    t0 = time.perf_counter()
    r = httpx.post(server.url + COMP, json={"prompt": "abc def " * 2_500_000, "max_tokens": 2}, timeout=60)
    err = _check_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert time.perf_counter() - t0 < 10


def test_malformed_json(server):
    r = httpx.post(server.url + CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "malformed JSON" in _check_error(r, 400)["message"]
    # a JSON body under another content type: the message says what to send
    r = httpx.post(server.url + COMP, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in _check_error(r, 422)["message"]


def test_unknown_route_and_method(server):
    err = _check_error(httpx.post(server.url + "/v1/embeddings", json={"input": "x"}), 404)
    assert "POST /v1/embeddings is not served here" in err["message"]
    assert "/v1/chat/completions" in err["message"]
    err = _check_error(httpx.get(server.url + COMP), 405)
    assert "GET is not allowed on /v1/completions" in err["message"]


def test_retrieve_the_model(server):
    """GET /v1/models/{id} (the SDKs' models.retrieve): the served model in OpenAI's and Anthropic's fields;
    another name is a 404 naming the served one, except under Anthropic's API (an anthropic-version header),
    whose /v1/messages answers any name."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    listed = client.models.list()
    name = listed.data[0].id
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model" and card.owned_by == "lumo"
    assert listed.model_extra["first_id"] == name and listed.model_extra["has_more"] is False
    with pytest.raises(openai.NotFoundError, match=f"this server serves '{name}'"):
        client.models.retrieve("gpt-4o")
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    other = ac.models.retrieve("claude-x")
    assert other.id == "claude-x" and other.type == "model" and other.created_at.year >= 2026


def test_harmless_openai_fields_are_accepted(server):
    body = {
        "model": None,
        "messages": [{"role": "developer", "content": "Be brief."}, *USER],
        "max_tokens": 2,
        "temperature": 0,
        "n": 1,
        "user": "someone",
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": None,
        "logprobs": False,
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "stream_options": None,
        "response_format": {"type": "text"},
        "some_future_field": [1, 2, 3],
    }
    r = httpx.post(server.url + CHAT, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    r = httpx.post(server.url + COMP, json={"prompt": "a", "max_tokens": 2, "logprobs": False}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None  # false: off, as in chat
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=client.models.list().data[0].id, messages=[])


def test_full_queue_gets_503_and_server_recovers(server):
    long = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": True}

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:

            async def stream(started: asyncio.Event) -> None:
                async with c.stream("POST", COMP, json=long) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            started.set()

            running = asyncio.Event()
            streams = [asyncio.create_task(stream(running))]
            await asyncio.wait_for(running.wait(), 30)
            streams.append(asyncio.create_task(stream(asyncio.Event())))  # takes the one queue place
            while await _ametric(c, "lumo_num_requests_waiting") < 1:
                await asyncio.sleep(0.01)
            r = await c.post(COMP, json={"prompt": "y", "max_tokens": 2})
            # a streamed one too: a 503 before its stream starts, not an error event in a 200
            r_stream = await c.post(CHAT, json={"messages": USER, "max_tokens": 2, "stream": True})
            for t in streams:  # hang up on both
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return r, r_stream

    for r in asyncio.run(scenario()):
        assert "busy" in _check_error(r, 503)["message"]
    # both streams were dropped: the engine is free again
    t0 = time.monotonic()
    r = httpx.post(server.url + COMP, json={"prompt": "y", "max_tokens": 4, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < 5


class _QueueFiller(ScriptedLLM):
    """A scripted engine that fills the server's queue with other (cancelled) requests just before each
    generation's last chunk: the next choice of the request is then queued with the queue full."""

    worker: Any = None
    loop: Any = None  # the other requests' event loop (never run: the worker only posts to it)
    filled: int = 0

    def generate_stream(self, prompt, max_tokens=256, **kw):
        chunks = list(super().generate_stream(prompt, max_tokens, **kw))
        if prompt == [1]:  # a filler itself
            yield from chunks
            return
        yield from chunks[:-1]
        while self.worker.queue_length() < self.worker.max_queue:
            # (not cancelled: a cancelled job leaves the queue, its place free at once)
            self.worker.submit(Job([1], 1, {}, self.loop), self.worker.admit())
            self.filled += 1
        yield chunks[-1]


def test_clients_that_leave_the_queue_free_their_places(server):
    """Queued requests whose clients hang up (streamed or not) leave the queue at once: with --max-queue 1
    and a long request running, a new request is admitted, not refused with a 503 by the ghosts."""
    long = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": True}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:

            async def stream(started: asyncio.Event | None = None) -> None:
                async with c.stream("POST", COMP, json=long) as r:
                    async for line in r.aiter_lines():
                        if started is not None and line.startswith("data: "):
                            started.set()

            running = asyncio.Event()
            first = asyncio.create_task(stream(running))
            await asyncio.wait_for(running.wait(), 30)
            cancelled0 = await _ametric(c, "lumo_requests_cancelled_total")
            for ghost in (stream(), c.post(COMP, json={"prompt": "y", "max_tokens": 50})):
                task = asyncio.create_task(ghost)
                while await _ametric(c, "lumo_num_requests_waiting") < 1:
                    await asyncio.sleep(0.01)
                task.cancel()  # the client hangs up while its request waits
                await asyncio.gather(task, return_exceptions=True)
                deadline = time.monotonic() + 5
                while await _ametric(c, "lumo_num_requests_waiting") > 0:
                    assert time.monotonic() < deadline, "the abandoned request still holds its place"
                    await asyncio.sleep(0.05)
            admitted = asyncio.create_task(c.post(COMP, json={"prompt": "y", "max_tokens": 2}))
            await asyncio.sleep(1.0)
            assert not admitted.done(), admitted.result().text  # waiting behind the long one, not a 503
            # counted when dropped (by the admission that needed their places at the latest)
            assert await _ametric(c, "lumo_requests_cancelled_total") == cancelled0 + 2
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            return await admitted

    r = asyncio.run(scenario())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_shutdown_answers_the_requests_in_flight(tmp_path):
    """SIGTERM with a stream running and a request waiting: the stream ends with an error event and
    [DONE], the waiting request gets a JSON 503, the server exits at once without tracebacks."""
    import signal
    import threading

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4, mtp_num_hidden_layers=0)
    gen_cfg = json.loads((ckpt / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [10**6]  # every generation runs to max_tokens
    (ckpt / "generation_config.json").write_text(json.dumps(gen_cfg))
    with serve_subprocess(ckpt, "--device", "cpu", env={"OMP_NUM_THREADS": "1"}) as s:
        got: dict[str, Any] = {}

        def stream() -> None:
            body = {"prompt": "x", "max_tokens": 4000, "stream": True}
            with httpx.stream("POST", s.url + COMP, json=body, timeout=60) as r:
                got["lines"] = [line for line in r.iter_lines() if line]

        def waiting() -> None:
            got["waiting"] = httpx.post(s.url + COMP, json={"prompt": "y", "max_tokens": 5}, timeout=60)

        threads = [threading.Thread(target=stream)]
        threads[0].start()
        deadline = time.monotonic() + 30
        while _metric(s.url, "lumo_num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        threads.append(threading.Thread(target=waiting))
        threads[1].start()
        while _metric(s.url, "lumo_num_requests_waiting") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=20)
        s.proc.wait(timeout=20)
        assert time.monotonic() - t0 < 4  # not uvicorn's 5 s graceful timeout running out
        assert got["lines"][-1] == "data: [DONE]"
        assert "shutting down" in json.loads(got["lines"][-2][6:])["error"]["message"]
        assert "shutting down" in _check_error(got["waiting"], 503)["message"]
        log = s.log()
        assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log


def test_jobs_of_a_request_admitted_before_shutdown_end_with_a_503(tmp_path):
    """A request admitted before shutdown began queues its (next) job after it: the job ends with the
    shutdown's 503 at once instead of hanging or ending empty; new requests are refused."""
    from lumo.server.errors import APIError
    from lumo.server.metrics import ServerMetrics
    from lumo.server.worker import EngineWorker

    llm = ScriptedLLM.with_test_tokenizer(tmp_path, "hello")
    worker = EngineWorker(llm, ServerMetrics(), max_queue=4)
    worker.start()
    loop = asyncio.new_event_loop()
    try:
        ticket = worker.admit()
        worker.stop()
        job = worker.submit(Job([1, 2], 4, {}, loop), ticket)

        async def drain() -> list:
            return [c async for c in job.events()]

        with pytest.raises(APIError, match="shutting down") as e:
            loop.run_until_complete(asyncio.wait_for(drain(), 5))
        assert e.value.status == 503
        with pytest.raises(APIError, match="shutting down"):
            worker.admit()
    finally:
        loop.close()


def test_seeds_at_the_int64_ends(server):
    """The largest seed with n = 2 (choice 1's seed wraps to the smallest) and the smallest one work."""
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": "a", "max_tokens": 3, "temperature": 1.0, "seed": seed, "n": 2}
        r = httpx.post(server.url + COMP, json=body, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_deeply_nested_tool_arguments_are_not_a_500(server):
    """Arguments nested past json's depth are text to the template (its own error, if any, is a 400)."""
    deep = '{"a":' * 1000 + "1" + "}" * 1000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "ok"}]
    items = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f"}]
    items[1]["arguments"] = deep
    for path, body in (
        (CHAT, {"messages": messages, "max_tokens": 2}),
        ("/tokenize", {"messages": messages}),
        ("/v1/responses", {"input": items, "max_output_tokens": 2}),
    ):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code in (200, 400), (path, r.text)
        if r.status_code == 400:
            _check_error(r, 400)


def test_concurrent_streams_get_503_or_a_whole_stream(server):
    """Streams arriving together: each is admitted (its place held before its stream starts) or refused
    with a 503, never a 200 whose stream is only a "server busy" error event."""
    long = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": True}

    async def one(c: httpx.AsyncClient, got: list[str], seen: asyncio.Event) -> None:
        async with c.stream("POST", COMP, json=long) as r:  # open until every stream is classified
            if r.status_code == 503:
                got.append("503")
                return
            assert r.status_code == 200
            lines = r.aiter_lines()
            try:
                async with asyncio.timeout(2.0):
                    while not (line := await anext(lines)).startswith("data: "):
                        pass
                    assert '"error"' not in line, line
                    got.append("running")
            except TimeoutError:
                got.append("waiting")  # admitted, its turn not come yet
            await seen.wait()

    async def scenario() -> list[str]:
        got: list[str] = []
        seen = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            tasks = [asyncio.create_task(one(c, got, seen)) for _ in range(6)]
            while len(got) < 6 and not any(t.done() and t.exception() for t in tasks):
                await asyncio.sleep(0.02)
            seen.set()
            await asyncio.gather(*tasks)
        return got

    got = asyncio.run(scenario())
    # --max-queue 1: one runs, at most one waits (a stream admitted while the first still held its place
    # is refused), the others were refused before their streams began
    assert len(got) == 6 and got.count("running") == 1 and got.count("waiting") <= 1, got
    deadline = time.monotonic() + 10
    while _metric(server.url, "lumo_num_requests_running") + _metric(server.url, "lumo_num_requests_waiting"):
        assert time.monotonic() < deadline, "the abandoned streams were not cancelled"
        time.sleep(0.05)


def test_full_queue_never_fails_an_admitted_request_half_done(tmp_path):
    """A request's later choices are queued as its earlier ones end; a queue that has filled meanwhile must
    not turn the finished choices into a 503 (lost work): the request was admitted with its first."""
    from fastapi.testclient import TestClient

    from lumo.server.app import create_app

    llm = _QueueFiller.with_test_tokenizer(tmp_path, "one two three", chunk=4)
    app = create_app(llm, max_queue=1)
    llm.worker, llm.loop = app.state.server.worker, asyncio.new_event_loop()
    with TestClient(app) as client:
        for path, body in ((COMP, {"prompt": "y"}), (CHAT, {"messages": USER})):
            for stream in (False, True):
                filled = llm.filled
                r = client.post(path, json={**body, "n": 3, "stream": stream})
                assert r.status_code == 200, r.text
                if stream:
                    stops = re.findall(r'"finish_reason": ?"stop"', r.text)
                    assert len(stops) == 3 and '"error"' not in r.text, r.text
                else:
                    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
                assert llm.filled - filled >= 2  # the queue was full when choices 1 and 2 were queued
    llm.loop.close()


async def _ametric(c: httpx.AsyncClient, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", (await c.get("/metrics")).text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _metric(url: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(url + "/metrics", timeout=10).text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_disconnect_mid_stream_frees_engine(server):
    url = server.url
    cancelled0 = _metric(url, "lumo_requests_cancelled_total")
    body = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", url + COMP, json=body) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break
    # leaving the `with` closed the connection mid-stream
    deadline = time.monotonic() + 5
    while _metric(url, "lumo_requests_cancelled_total") == cancelled0:
        assert time.monotonic() < deadline, "the disconnected stream was not cancelled"
        time.sleep(0.02)
    assert _metric(url, "lumo_num_requests_running") == 0
    tokens0 = _metric(url, "lumo_generation_tokens_total")
    t0 = time.monotonic()
    r = httpx.post(url + COMP, json={"prompt": "y", "max_tokens": 8, "temperature": 0}, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    # only the new request generated since: the abandoned one (4000 tokens asked) really stopped
    assert _metric(url, "lumo_generation_tokens_total") - tokens0 == 8
    assert elapsed < 5


def test_disconnect_while_waiting_for_non_streamed_response(server):
    cancelled0 = _metric(server.url, "lumo_requests_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + COMP, json={"prompt": "x", "max_tokens": 4000, "temperature": 0}, timeout=0.5)
    deadline = time.monotonic() + 5
    while _metric(server.url, "lumo_requests_cancelled_total") == cancelled0:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.02)
    assert _metric(server.url, "lumo_num_requests_running") == 0


def test_server_still_healthy(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(server.url + "/metrics").text
    assert 'lumo_requests_total{endpoint="/v1/chat/completions",status="422"}' in metrics
    assert server.proc.poll() is None


def test_logit_bias_keys_and_clamping():
    """logit_bias keys are token ids (strings in JSON), values clamped to [-100, 100] (OpenAI's range, as
    vLLM clamps); no token settings: the vocabulary is not asked for."""
    from lumo.server.protocol import CompletionRequest

    body = CompletionRequest(prompt="a", logit_bias={"5": 250, "7": -1e9, "9": 0.5}, stop_token_ids=[3])
    assert body.token_settings(lambda: 10) == {
        "logit_bias": {5: 100.0, 7: -100.0, 9: 0.5},
        "stop_token_ids": [3],
    }
    assert CompletionRequest(prompt="a").token_settings(lambda: 1 / 0) == {}
