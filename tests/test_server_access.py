"""Who may call the server: `lumo serve --api-key` (or $LUMO_API_KEY) and `--allowed-origins` (CORS)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import re

import httpx
import openai
from fastapi.testclient import TestClient

from lumo.server.app import create_app
from lumo.server.testing import ScriptedLLM, serve_in_thread, serve_subprocess

KEY = "sk-lumo-test"
CHAT = "/v1/chat/completions"
USER = {"messages": [{"role": "user", "content": "hi"}]}
PAGE = "http://localhost:3000"


@pytest.fixture
def llm(tmp_path):
    return ScriptedLLM.with_test_tokenizer(tmp_path, "Hello there.")


def test_api_key_guards_every_route_but_health_and_metrics(llm):
    with TestClient(create_app(llm, api_key=KEY)) as c:
        calls = [
            ("GET", "/v1/models", None),
            ("POST", CHAT, USER),
            ("POST", "/v1/completions", {"prompt": "x"}),
        ]
        calls += [("POST", "/v1/responses", {"input": "x"}), ("POST", "/tokenize", {"prompt": "x"})]
        calls += [("POST", "/detokenize", {"tokens": [1]}), ("GET", "/no/such/route", None)]
        for method, path, body in calls:
            for auth in (None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer"):
                headers = {} if auth is None else {"Authorization": auth}
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, auth, r.text)
                assert (
                    r.json()["error"]["code"] == "invalid_api_key"
                    and r.headers["www-authenticate"] == "Bearer"
                )
            r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == (404 if path == "/no/such/route" else 200), (path, r.text)
        assert c.post(CHAT, json=USER, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert c.get("/health").status_code == 200
        metrics = c.get("/metrics").text
        assert re.search(r'lumo_requests_total\{endpoint="/v1/chat/completions",status="401"\} 6', metrics)
    with TestClient(create_app(llm)) as c:  # no key: open
        assert c.post(CHAT, json=USER).status_code == 200


def test_openai_client_with_and_without_the_key(llm):
    with serve_in_thread(llm, api_key=KEY) as url:
        ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        r = ok.chat.completions.create(model="scripted", messages=USER["messages"])
        assert r.choices[0].message.content == "Hello there."
        chunks = ok.chat.completions.create(model="scripted", messages=USER["messages"], stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello there."
        bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
            bad.chat.completions.create(model="scripted", messages=USER["messages"], stream=True)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_cors_preflight_and_origins(llm):
    preflight = {"Origin": PAGE, "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization, content-type"
    with TestClient(create_app(llm, api_key=KEY, allowed_origins=[PAGE])) as c:
        r = c.options(CHAT, headers=preflight)  # a browser's preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.post(CHAT, json=USER, headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        r = c.post(CHAT, json=USER, headers={"Origin": PAGE})  # the key is still needed
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE
        other = {"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"}
        assert "access-control-allow-origin" not in c.post(CHAT, json=USER, headers=other).headers
        assert c.options(CHAT, headers={**preflight, "Origin": "http://evil.example"}).status_code == 400
    with TestClient(create_app(llm, allowed_origins=["*"])) as c:
        r = c.post(CHAT, json=USER, headers={"Origin": "http://anywhere.example"})
        assert r.headers["access-control-allow-origin"] == "*"
    with TestClient(create_app(llm)) as c:  # default: no CORS, a browser page elsewhere may not read replies
        r = c.post(CHAT, json=USER, headers={"Origin": PAGE})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert c.options(CHAT, headers=preflight).status_code == 405


def test_lumo_serve_takes_the_key_from_the_environment(tmp_path):
    """The CLI end to end: $LUMO_API_KEY (--api-key overrides it), the startup line says a key is needed."""
    from lumo.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4, mtp_num_hidden_layers=0)
    args = ("--device", "cpu", "--allowed-origins", PAGE)
    with serve_subprocess(ckpt, *args, env={"LUMO_API_KEY": KEY, "OMP_NUM_THREADS": "1"}) as s:
        body = {"prompt": "x", "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(
            s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        assert "(API key required)" in s.log()
    with serve_subprocess(ckpt, "--device", "cpu", "--api-key", "other", env={"LUMO_API_KEY": KEY}) as s:
        headers = {"Authorization": "Bearer other"}
        assert httpx.get(s.url + "/v1/models", headers=headers, timeout=10).status_code == 200
        assert (
            httpx.get(
                s.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
            ).status_code
            == 401
        )
