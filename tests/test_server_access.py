"""Who may call the server: `lumo serve --api-key` (or $LUMO_API_KEY) and `--allowed-origins` (CORS)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import re
import shutil

import httpx
import openai
from fastapi.testclient import TestClient

import lumo
from lumo.server.app import create_app
from lumo.server.testing import ScriptedLLM, serve_in_thread, serve_subprocess

KEY = "sk-lumo-test"
CHAT = "/v1/chat/completions"
USER = {"messages": [{"role": "user", "content": "hi"}]}
PAGE = "http://localhost:3000"


@pytest.fixture
def llm(tmp_path):
    return ScriptedLLM.with_test_tokenizer(tmp_path, "Hello there.")


def test_api_key_guards_every_route_but_probes_version_and_metrics(llm):
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
        for probe in (c.get("/health"), c.get("/ping"), c.post("/ping")):
            assert probe.status_code == 200 and probe.json() == {"status": "ok"}
        assert c.get("/version").json() == {"version": lumo.__version__}
        metrics = c.get("/metrics").text
        assert re.search(r'lumo_requests_total\{endpoint="/v1/chat/completions",status="401"\} 6', metrics)
    with TestClient(create_app(llm)) as c:  # no key: open
        assert c.post(CHAT, json=USER).status_code == 200


def test_an_empty_key_is_refused(llm):
    """An empty (or blank) key would match a request that sends none: refused, not an open server."""
    for key in ("", "  \n"):
        with pytest.raises(ValueError, match="empty"):
            create_app(llm, api_key=key)


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
        body = {"prompt": "x", "max_tokens": 2, "ignore_eos": True}  # sampled: the count must not hang on it
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


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_with_a_certificate(tmp_path):
    """--ssl-certfile / --ssl-keyfile: the server speaks TLS (checked against the certificate), the
    startup line says https; a missing or mismatched file is a one-line error before the model loads."""
    import ssl
    import subprocess
    import sys
    import time

    from lumo.server.testing import free_port
    from lumo.testing import make_tiny_checkpoint

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4, mtp_num_hidden_layers=0)
    port = free_port()
    cmd = [sys.executable, "-m", "lumo.cli", "serve", str(ckpt), "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        verify = ssl.create_default_context(cafile=str(cert))
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", verify=verify, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        body = {"prompt": "x", "max_tokens": 2, "ignore_eos": True}  # sampled: the count must not hang on it
        r = httpx.post(url + "/v1/completions", json=body, verify=verify, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert f"at https://127.0.0.1:{port}/v1" in out
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    for flags, words in (
        (["--ssl-certfile", str(cert)], "needs both"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "none.pem")], "no such TLS file"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(other)], "cannot use"),  # not this cert's key
    ):
        r = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
