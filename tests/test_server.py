"""`lumo serve` over real HTTP: one server subprocess (tiny random checkpoint, CPU) for the whole file.

Outputs are compared with the in-process engine (`LLM.generate`, greedy) on the same checkpoint, so the
server must pass prompts, parameters, text, finish reasons and token counts through unchanged.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import asyncio
import json
import re
import subprocess
import sys

import httpx
import openai
import torch

from lumo.engine.llm import LLM
from lumo.server.app import PROMPT_CHARS_SLACK
from lumo.server.chat import opens_reasoning
from lumo.server.testing import serve_subprocess
from lumo.server.toolparse import ChatOutputParser
from lumo.testing import make_tiny_checkpoint

# One engine thread per process: the tiny model is dominated by per-op overhead, which threads only add to.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4, mtp_num_hidden_layers=0)


@pytest.fixture(scope="module")
def llm(ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(ckpt), device="cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(ckpt):
    with serve_subprocess(ckpt, "--device", "cpu", "--max-queue", "32", env=ONE_THREAD) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _sse(resp: httpx.Response) -> list[dict]:
    """The JSON events of an SSE response; checks that the stream ends with [DONE]."""
    data = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _parsed(prompt: str, text: str) -> tuple[str, str]:
    p = ChatOutputParser(in_reasoning=opens_reasoning(prompt), parse_tools=False)
    a, b = p.feed(text), p.finish()
    return a.content + b.content, a.reasoning + b.reasoning


def generated(r) -> int:
    """The tokens a result generated as usage counts them: an end token that ended it too (as vLLM counts)."""
    return len(r.token_ids) + (r.end_token is not None)


def _metric(url: str, name: str, missing: float | None = None) -> float:
    """A sample's value; `missing` (if given) when the series has no sample yet (a labelled counter)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if m is None and missing is not None:
        return missing
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_startup_line_models_health(server, ckpt):
    assert f"at {server.url}/v1" in server.log() and ckpt.name in server.log()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [ckpt.name]


@pytest.mark.parametrize("max_tokens", [1, 12])
def test_completion_matches_engine(client, server, llm, max_tokens):
    prompt = "The quick brown fox"
    ref = llm.generate(prompt, max_tokens=max_tokens, temperature=0)
    tokens0 = _metric(server.url, "lumo_generation_tokens_total", missing=0)
    r = client.completions.create(model=llm.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0)
    # /metrics counts what usage counts, an end token that ended the output too (12 tokens: one does)
    assert _metric(server.url, "lumo_generation_tokens_total") - tokens0 == r.usage.completion_tokens
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        generated(ref),
    )

    events = client.completions.create(
        model=llm.model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(events)
    assert "".join(e.choices[0].text for e in events if e.choices) == ref.text
    assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == [
        ref.finish_reason
    ]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == generated(ref)
    assert events[-1].usage.total_tokens == len(ref.prompt_token_ids) + generated(ref)


def test_completion_token_prompt_and_default_length(server, llm):
    ids = llm.tokenizer.encode("Hello, world!")
    ref = llm.generate(ids, max_tokens=16, temperature=0)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "temperature": 0}, timeout=30).json()
    assert r["choices"][0]["text"] == ref.text  # OpenAI's default max_tokens for completions is 16
    assert r["usage"]["completion_tokens"] == generated(ref)


@pytest.mark.parametrize("max_tokens", [3, 40])
def test_chat_matches_engine(client, llm, max_tokens):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, how are you?"},
    ]
    prompt = llm.tokenizer.apply_chat_template(messages)
    ref = llm.generate(prompt, max_tokens=max_tokens, temperature=0)
    content, reasoning = _parsed(prompt, ref.text)
    kw = {
        "model": llm.model_name,
        "messages": messages,
        "max_completion_tokens": max_tokens,
        "temperature": 0,
    }
    r = client.chat.completions.create(**kw, user="u1", presence_penalty=0, logit_bias=None, store=False)
    msg = r.choices[0].message
    assert (msg.content, (msg.model_extra or {}).get("reasoning_content") or "") == (content, reasoning)
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        generated(ref),
    )

    events = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert deltas[0].role == "assistant"
    streamed = "".join(d.content or "" for d in deltas)
    streamed_r = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert (streamed, streamed_r) == (content, reasoning)
    assert events[-2].choices[0].finish_reason == ref.finish_reason
    assert events[-1].usage.completion_tokens == generated(ref)


def test_continuous_usage_stats_on_every_chunk(server, llm):
    """vLLM's continuous_usage_stats (with include_usage): every chunk carries its choice's usage so far,
    rising to the choice's tokens; the last chunk is the request's usage (two choices: both counted);
    without include_usage no chunk carries usage. It was a 400 until session 48."""
    both = {"include_usage": True, "continuous_usage_stats": True}
    kw = {"max_tokens": 12, "temperature": 0.8, "seed": 5, "n": 2, "stream": True}
    user = [{"role": "user", "content": "Hello, how are you?"}]
    for path, body in (("/v1/completions", {"prompt": "The quick brown fox"}), ("/v1/chat/completions", {})):
        body = {**body, **({"messages": user} if "chat" in path else {}), **kw}
        with httpx.stream("POST", server.url + path, json={**body, "stream_options": both}, timeout=60) as r:
            events = _sse(r)
        *chunks, last = events
        n_prompt = last["usage"]["prompt_tokens"]
        per_choice = {0: [], 1: []}
        for e in chunks:
            u = e["usage"]
            assert u == {  # no prompt_tokens_details: the cached count is the last chunk's, the request's
                "prompt_tokens": n_prompt,
                "completion_tokens": u["completion_tokens"],
                "total_tokens": n_prompt + u["completion_tokens"],
            }
            per_choice[e["choices"][0]["index"]].append(u["completion_tokens"])
        for counts in per_choice.values():
            assert counts == sorted(counts) and counts[-1] >= 1, (path, counts)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(
            c[-1] for c in per_choice.values()
        )
        with httpx.stream(
            "POST", server.url + path, json={**body, "stream_options": {"continuous_usage_stats": True}}
        ) as r:
            assert all("usage" not in e for e in _sse(r)), path


def test_stop_strings(client, llm, server):
    prompt = "Numbers: 0 1 2"
    text = llm.generate(prompt, max_tokens=30, temperature=0).text
    candidates = [text[k : k + 2] for k in range(3, len(text) - 2) if "\ufffd" not in text[k : k + 2]]
    assert candidates, f"greedy output too short for a stop test: {text!r}"
    stop = candidates[len(candidates) // 2]
    for form in (stop, ["never-appears", stop]):
        r = client.completions.create(
            prompt=prompt, max_tokens=30, temperature=0, stop=form, model=llm.model_name
        )
        assert r.choices[0].text == text[: text.find(stop)]
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens <= 30
        assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's field: the string that matched
    r = client.completions.create(prompt=prompt, max_tokens=3, temperature=0, model=llm.model_name)
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["stop_reason"] is None
    # streamed: on the chunk that finishes the choice; chat too
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": [stop], "stream": True}
    events = _sse(httpx.post(server.url + "/v1/completions", json=body, timeout=60))
    last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 30, "temperature": 0}
    chat["ignore_eos"] = True
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    assert (reply["finish_reason"], reply["stop_reason"]) == ("length", None)
    content = reply["message"]["content"]
    cut = next(content[k : k + 2] for k in range(2, len(content) - 2) if content[k : k + 2].strip())
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "stop": [cut]}, timeout=60).json()
    assert (r["choices"][0]["finish_reason"], r["choices"][0]["stop_reason"]) == ("stop", cut)


def test_seeded_sampling_repeats(client, llm):
    kw = {
        "model": llm.model_name,
        "prompt": "Hello",
        "max_tokens": 20,
        "temperature": 1.0,
        "top_p": 0.9,
        "extra_body": {"top_k": 50},
    }
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    assert a == b
    greedy = llm.generate("Hello", max_tokens=20, temperature=0).text
    assert a != greedy  # it really sampled
    # a temperature past OpenAI's cap of 2 is served, as vLLM serves it (a 422 until session 48)
    hot = client.completions.create(**{**kw, "temperature": 5.0, "max_tokens": 6}, seed=7)
    ref = llm.generate("Hello", max_tokens=6, temperature=5.0, top_p=0.9, top_k=50, seed=7)
    assert hot.choices[0].text == ref.text


async def _one(client: httpx.AsyncClient, kind: str, body: dict) -> str:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if not body.get("stream"):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    out = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                delta = ev["choices"][0]["delta"] if kind == "chat" else ev["choices"][0]
                out.append(delta.get("content" if kind == "chat" else "text") or "")
    return "".join(out)


def test_twenty_concurrent_requests_match_alone(server):
    words = ["fox", "dog", "world", "today", "model", "answer", "Paris", "café", "日本", "numbers"]
    reqs = []
    for i in range(20):
        kind = "chat" if i % 2 else "completion"
        body = {"max_tokens": 6 + i, "temperature": 0, "stream": i % 4 in (2, 3)}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": f"Tell me about {words[i % 10]} {i}"}]
        else:
            body["prompt"] = f"The {words[i % 10]} number {i} is"
        reqs.append((kind, body))

    async def run(concurrent: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            if concurrent:
                return list(await asyncio.gather(*(_one(c, k, b) for k, b in reqs)))
            return [await _one(c, k, b) for k, b in reqs]

    alone = asyncio.run(run(False))
    together = asyncio.run(run(True))
    assert together == alone
    assert len(set(alone)) > 10  # distinct requests gave distinct outputs: a mix-up would show


def test_metrics_exposition(server):
    before = _metric(server.url, 'lumo_requests_total{endpoint="/v1/completions",status="200"}', missing=0)
    httpx.post(
        server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3, "temperature": 0}, timeout=30
    )
    text = httpx.get(server.url + "/metrics").text
    after = _metric(server.url, 'lumo_requests_total{endpoint="/v1/completions",status="200"}')
    assert after == before + 1
    for name in (
        "lumo_prompt_tokens_total",
        "lumo_prompt_tokens_cached_total",
        "lumo_spec_plain_steps_total",
        "lumo_generation_tokens_total",
        "lumo_time_to_first_token_seconds_count",
        "lumo_inter_token_latency_seconds_count",
        "lumo_num_requests_waiting",
    ):
        assert re.search(rf"^{name} \d", text, re.M), name
    assert re.search(r'^lumo_time_to_first_token_seconds_bucket\{le="\+Inf"\} [1-9]', text, re.M)
    for line in text.splitlines():  # every sample line is NAME{labels} VALUE
        assert line.startswith("#") or re.fullmatch(
            r'[a-z_:][a-z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? \S+', line
        )
    # vLLM's names for the same numbers (dashboards built on vLLM's /metrics), with its model_name label
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    for lumo_name, vllm_name in (
        ("lumo_generation_tokens_total", "vllm:generation_tokens_total"),
        ("lumo_prompt_tokens_cached_total", "vllm:prefix_cache_hits_total"),
        ("lumo_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("lumo_num_requests_waiting", "vllm:num_requests_waiting"),
    ):
        mine = re.search(rf"^{lumo_name} (\S+)$", text, re.M).group(1)
        assert re.search(rf'^{vllm_name}\{{model_name="{model}"\}} {re.escape(mine)}$', text, re.M), vllm_name


def test_embedded_model_with_tree_speculation():
    """`lumo serve` with no model serves the embedded model; with --spec tree the output is plain greedy's
    and /metrics counts accepted drafts per event."""
    from lumo.engine.llm import embedded_model_path

    if not (embedded_model_path() / "config.json").exists():
        pytest.skip("the embedded model is not in lumo/assets")
    prompt = "def fibonacci(n):"
    want = LLM(device="cpu").generate(prompt, max_tokens=24, temperature=0).text
    with serve_subprocess(None, "--spec", "tree", "--device", "cpu", env={"OMP_NUM_THREADS": "1"}) as srv:
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["lumo-tiny"]
        body = {"model": "lumo-tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["text"] == want
        assert _metric(srv.url, "lumo_spec_accepted_drafts_count") > 0


def test_a_vllm_command_line_serves(ckpt):
    """`lumo serve` with the flags of a typical `vllm serve` command for a Qwen3.5 model: each ignored one
    says what lumo does instead, --no-enable-prefix-caching turns the prefix cache off (a repeated 600-token
    prompt: 0 cached tokens, 512 with it on), two served names are both accepted, and the server serves;
    more than one GPU is refused before anything loads."""
    vllm = ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"]
    vllm += ["--gpu-memory-utilization", "0.85", "--trust-remote-code", "-tp", "1", "--dtype", "auto"]
    vllm += ["--no-async-scheduling", "--served-model-name", "qwen", "qwen3.5-27b"]
    vllm += ["--speculative-config", '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}']
    ids = torch.randint(1, 200, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    for flag, cached in (("--enable-prefix-caching", 512), ("--no-enable-prefix-caching", 0)):
        with serve_subprocess(ckpt, "--device", "cpu", *vllm, flag, env=ONE_THREAD) as srv:
            for name in ("qwen3.5-27b", "qwen"):  # vLLM's several names: all accepted, the first answers
                body = {"model": name, "prompt": ids, "max_tokens": 2, "temperature": 0}
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
                assert r.json()["model"] == "qwen"
            models = httpx.get(srv.url + "/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["qwen", "qwen3.5-27b"]
            assert httpx.post(srv.url + "/v1/completions", json={**body, "model": "other"}).status_code == 404
            assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
            notes = [line for line in srv.log().splitlines() if "(vLLM's)" in line]
        assert len(notes) == 7 + (cached == 0), notes
        said = "--gpu-memory-utilization 0.85 (vLLM's) has no effect here: the context"
        assert any(said in n for n in notes), notes
    r = subprocess.run(
        [sys.executable, "-m", "lumo.cli", "serve", str(ckpt), "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "one GPU" in r.stderr, r.stderr


def test_prefix_cache_reuse_is_reported_and_changes_nothing(server, llm):
    """A second request sharing a 600-token prefix with the first resumes from the prefill snapshot at 512
    tokens (the reference decoder's chunk): usage and /metrics report it, and the text is a cold engine's."""
    rng = torch.Generator().manual_seed(11)
    first = torch.randint(1, llm.tokenizer.vocab_size, (600,), generator=rng).tolist()
    second = first + torch.randint(1, llm.tokenizer.vocab_size, (30,), generator=rng).tolist()
    before = _metric(server.url, "lumo_prompt_tokens_cached_total")
    usage = []
    for ids in (first, second):
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0}
        usage.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"])
    assert usage[1]["prompt_tokens_details"] == {"cached_tokens": 512}
    assert _metric(server.url, "lumo_prompt_tokens_cached_total") - before == 512
    body = {"prompt": second, "max_tokens": 6, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        events = _sse(resp)
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 512}
    cold = LLM(llm.path, device="cpu", prefix_snapshots=0).generate(second, max_tokens=6, temperature=0)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == cold.text


def test_chat_logprobs_streamed_and_not(client, llm):
    """OpenAI's chat logprobs: an entry per generated token (text, logprob, bytes, top_logprobs), the
    engine's numbers, the same entries whether streamed or not."""
    messages = [{"role": "user", "content": "Say something."}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    ref = llm.generate(prompt, max_tokens=10, temperature=0, logprobs=3)
    kw = dict(model=llm.model_name, messages=messages, max_tokens=10, temperature=0, logprobs=True)
    r = client.chat.completions.create(**kw, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    tok = llm.tokenizer
    assert [e.token for e in entries] == [tok.token_text(t) for t in ref.token_ids]
    assert [bytes(e.bytes) for e in entries] == [tok.token_bytes(t) for t in ref.token_ids]
    assert [e.logprob for e in entries] == [t.logprob for t in ref.logprobs]
    for e, t in zip(entries, ref.logprobs, strict=True):
        assert [(x.token, x.logprob) for x in e.top_logprobs] == [(tok.token_text(i), v) for i, v in t.top]
    events = list(client.chat.completions.create(**kw, top_logprobs=3, stream=True))
    chunks = [ev.choices[0].logprobs for ev in events if ev.choices and ev.choices[0].logprobs]
    streamed = [e for lp in chunks for e in lp.content]
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [
        (e.token, e.logprob, e.top_logprobs) for e in entries
    ]
    plain = client.chat.completions.create(**kw)  # top_logprobs unset: the chosen tokens only
    assert [e.logprob for e in plain.choices[0].logprobs.content] == [e.logprob for e in entries]
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(**{**kw, "logprobs": False}).choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(client, llm):
    """The completions API's lists: tokens, token_logprobs, top_logprobs (the k best and the chosen token)
    and text_offset, streamed chunk by chunk with offsets that continue."""
    prompt = "The quick brown fox"
    ref = llm.generate(prompt, max_tokens=8, temperature=0.7, seed=4, logprobs=2)
    kw = dict(model=llm.model_name, prompt=prompt, max_tokens=8, temperature=0.7, seed=4, logprobs=2)
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    tok = llm.tokenizer
    texts = [tok.token_text(t) for t in ref.token_ids]
    assert choice.text == ref.text and lp.tokens == texts
    assert lp.token_logprobs == [t.logprob for t in ref.logprobs]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for s, off in zip(texts, lp.text_offset, strict=True):  # each whole token's text where it starts
        assert "\ufffd" in s or choice.text[off : off + len(s)] == s
    for top, t, s in zip(lp.top_logprobs, ref.logprobs, texts, strict=True):
        want = {}
        for i, v in t.top:
            want.setdefault(tok.token_text(i), v)
        want.setdefault(s, t.logprob)
        assert top == want
    events = [e for e in client.completions.create(**kw, stream=True) if e.choices and e.choices[0].logprobs]
    assert [x for e in events for x in e.choices[0].logprobs.tokens] == lp.tokens
    assert [x for e in events for x in e.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [x for e in events for x in e.choices[0].logprobs.text_offset] == lp.text_offset


def test_echo_scores_the_prompt(client, server, llm):
    """echo with logprobs (lm-eval-harness's loglikelihood request): the prompt's text and tokens first,
    its first token with null logprobs, the others as the engine scores them; max_tokens 0 generates
    nothing; streamed, the first chunk carries the prompt."""
    prompt = "The quick brown fox jumps over"
    ref = llm.generate(prompt, max_tokens=4, temperature=0, logprobs=1, prompt_logprobs=1)
    tok = llm.tokenizer
    ids = ref.prompt_token_ids + ref.token_ids
    kw = dict(model=llm.model_name, prompt=prompt, temperature=0, echo=True, logprobs=1)
    r = client.completions.create(**kw, max_tokens=4)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt + ref.text
    assert lp.tokens == [tok.token_text(i) for i in ids]
    assert lp.token_logprobs == [None] + [t.logprob for t in ref.prompt_logprobs[1:] + ref.logprobs]
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(ids)
    assert lp.text_offset[len(ref.prompt_token_ids)] == sum(map(len, lp.tokens[: len(ref.prompt_token_ids)]))
    tokens0 = _metric(server.url, "lumo_generation_tokens_total", missing=0)
    scored = client.completions.create(**kw, max_tokens=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert _metric(server.url, "lumo_generation_tokens_total") == tokens0  # /metrics counts what usage does
    assert scored.choices[0].finish_reason == "length"
    n = len(ref.prompt_token_ids)
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    events = [e for e in client.completions.create(**kw, max_tokens=4, stream=True) if e.choices]
    assert events[0].choices[0].text.startswith(prompt)
    assert "".join(e.choices[0].text for e in events) == prompt + ref.text
    assert [x for e in events if e.choices[0].logprobs for x in e.choices[0].logprobs.token_logprobs] == (
        lp.token_logprobs
    )
    plain = client.completions.create(**{**kw, "logprobs": None}, max_tokens=4)  # echo alone: text only
    assert plain.choices[0].text == prompt + ref.text and plain.choices[0].logprobs is None


def _prompt_entries_want(tok, ref, k):
    """vLLM's prompt_logprobs from the engine's prompt scores (k alternatives): null, then per token id
    its logprob, rank and text."""
    want = [None]
    for t in ref.prompt_logprobs[1:]:
        entry = {str(t.token): (t.logprob, t.rank, tok.token_text(t.token))}
        for r, (i, v) in enumerate(t.top[:k], 1):
            entry.setdefault(str(i), (v, r, tok.token_text(i)))
        want.append(entry)
    return want


def _entries(got):
    return [
        None if e is None else {i: (x["logprob"], x["rank"], x["decoded_token"]) for i, x in e.items()}
        for e in got
    ]


def test_prompt_logprobs(server, llm):
    """vLLM's prompt_logprobs: per prompt token (the first null) its logprob, rank and text and its k
    alternatives (ranks 1..k), the engine's numbers; on every choice of /v1/completions, at the top level
    of a chat response; echo's own alternatives stay echo's k; a stream may ask only 0."""
    tok = llm.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog"
    ref = llm.generate(prompt, max_tokens=3, temperature=0, prompt_logprobs=20)
    # the rank is the engine's own count; where the token is among the 20 most likely, its place there
    n_ranked = 0
    for t in ref.prompt_logprobs[1:]:
        ids = [i for i, _ in t.top]
        if t.token in ids:
            n_ranked += 1
            assert t.rank == ids.index(t.token) + 1
        else:
            assert t.rank > 20
    assert n_ranked > 0
    body = {"model": llm.model_name, "prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2}
    r = httpx.post(server.url + "/v1/completions", json={**body, "prompt_logprobs": 2}, timeout=60).json()
    want = _prompt_entries_want(tok, ref, 2)
    assert [_entries(c["prompt_logprobs"]) for c in r["choices"]] == [want, want]
    assert r["choices"][0]["text"] == ref.text and r["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    # echo's logprobs keep their own k (1: the token and one alternative) beside prompt_logprobs' 3
    r = httpx.post(
        server.url + "/v1/completions",
        json={**body, "n": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 3},
        timeout=60,
    ).json()
    assert _entries(r["choices"][0]["prompt_logprobs"]) == _prompt_entries_want(tok, ref, 3)
    tops = r["choices"][0]["logprobs"]["top_logprobs"][1 : len(ref.prompt_token_ids)]
    assert all(1 <= len(top) <= 2 for top in tops)
    # chat: at the top level, the rendered prompt's tokens
    messages = [{"role": "user", "content": "Say something."}]
    chat_ref = llm.generate(tok.apply_chat_template(messages), max_tokens=3, temperature=0, prompt_logprobs=1)
    chat = {"model": llm.model_name, "messages": messages, "max_tokens": 3, "temperature": 0}
    r = httpx.post(
        server.url + "/v1/chat/completions", json={**chat, "prompt_logprobs": 1}, timeout=60
    ).json()
    assert _entries(r["prompt_logprobs"]) == _prompt_entries_want(tok, chat_ref, 1)
    # max_tokens 0: the prompt scored, nothing generated
    r = httpx.post(
        server.url + "/v1/completions",
        json={**body, "n": 1, "max_tokens": 0, "prompt_logprobs": 2},
        timeout=60,
    ).json()
    assert r["choices"][0]["text"] == "" and r["usage"]["completion_tokens"] == 0
    assert _entries(r["choices"][0]["prompt_logprobs"]) == want
    # not asked: null, as vLLM's (the key is there); on completions also for echo with logprobs
    assert (
        httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()["prompt_logprobs"]
        is None
    )
    r = httpx.post(server.url + "/v1/completions", json={**body, "n": 1}, timeout=60).json()
    assert r["choices"][0]["prompt_logprobs"] is None
    r = httpx.post(
        server.url + "/v1/completions", json={**body, "n": 1, "echo": True, "logprobs": 2}, timeout=60
    )
    assert _entries(r.json()["choices"][0]["prompt_logprobs"]) == _prompt_entries_want(tok, ref, 2)
    # a stream may ask for 0 (ignored, as vLLM does)
    r = httpx.post(
        server.url + "/v1/chat/completions", json={**chat, "prompt_logprobs": 0, "stream": True}, timeout=60
    )
    assert r.status_code == 200 and _sse(r)[-1]["choices"][0]["finish_reason"]


def test_truncate_prompt_tokens(server, llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens only (the output and usage are those of
    that prompt alone; echo shows what the model saw), its first k with truncation_side "right"; -1 keeps
    the most that leave room for max_tokens, so a prompt longer than the context is served. A k that
    leaves no room for max_tokens is a 400 whatever the prompt's length, and -1 needs max_tokens on chat
    (whose default is the room left)."""
    tok = llm.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt)
    ref = llm.generate(ids[-4:], max_tokens=5, temperature=0)
    body = {"model": llm.model_name, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    r = httpx.post(
        server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": 4}, timeout=60
    ).json()
    assert r["choices"][0]["text"] == ref.text and r["usage"]["prompt_tokens"] == 4
    r = httpx.post(
        server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": 4, "echo": True}, timeout=60
    ).json()
    assert r["choices"][0]["text"] == tok.decode(ids[-4:]) + ref.text
    right = {**body, "truncate_prompt_tokens": 4, "truncation_side": "right", "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=right, timeout=60).json()
    head = llm.generate(ids[:4], max_tokens=5, temperature=0)
    assert r["choices"][0]["text"] == tok.decode(ids[:4]) + head.text and r["usage"]["prompt_tokens"] == 4
    limit = llm.max_model_len
    # as vLLM: a k up to the context is a cap (a short prompt is served whole), the kept prompt then
    # checked as any other; a k above the context is a 400
    r = httpx.post(server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": limit}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    r = httpx.post(
        server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": limit + 1}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    long = {**body, "prompt": "hello world " * 3000}  # longer than the context of 4096
    # OpenAI's wording, which clients look for (LiteLLM's ContextWindowExceededError)
    openai_words = f"This model's maximum context length is {limit} tokens. However,"
    r = httpx.post(server.url + "/v1/completions", json=long, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(openai_words)
    r = httpx.post(
        server.url + "/v1/completions", json={**long, "truncate_prompt_tokens": limit - 4}, timeout=60
    )  # 4092 kept + 5 new > 4096
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"].startswith(openai_words)
    r = httpx.post(server.url + "/v1/completions", json={**long, "truncate_prompt_tokens": -1}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == llm.max_model_len - 5
    # a text too long to tokenise without truncation (refused at once) is tokenised when truncated
    huge = "hello world " * (PROMPT_CHARS_SLACK * limit * tok.max_token_chars // 12 + 1)
    r = httpx.post(server.url + "/v1/completions", json={**body, "prompt": huge}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(openai_words)
    r = httpx.post(
        server.url + "/v1/completions",
        json={**body, "prompt": huge, "truncate_prompt_tokens": 16},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16
    messages = [{"role": "user", "content": "Say something."}]
    chat_ids = tok.encode(tok.apply_chat_template(messages))
    chat_ref = llm.generate(chat_ids[-3:], max_tokens=4, temperature=0)
    chat = {"model": llm.model_name, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(
        server.url + "/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 3}, timeout=60
    )
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert r.json()["choices"][0]["message"]["content"] == _parsed("", chat_ref.text)[0]
    unbounded = {k: v for k, v in chat.items() if k != "max_tokens"}
    r = httpx.post(
        server.url + "/v1/chat/completions", json={**unbounded, "truncate_prompt_tokens": -1}, timeout=60
    )
    assert r.status_code == 400 and "needs max_tokens" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/completions",
        json={**long, "max_tokens": limit, "truncate_prompt_tokens": -1},
        timeout=60,
    )
    assert r.status_code == 400 and "leaves no room for a prompt" in r.json()["error"]["message"]


def test_return_token_ids(server, llm):
    """vLLM's return_token_ids: the prompt's ids and the output's, the end token that ended it included
    (here a stop token id), on completions' choices (streamed: the prompt's on a choice's first chunk, each
    chunk its own) and on chat (the prompt's at the top level)."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ref = llm.generate(prompt, max_tokens=12, temperature=0)
    stop = ref.token_ids[4]
    cut = llm.generate(prompt, max_tokens=12, temperature=0, stop_token_ids=[stop])
    assert cut.end_token == stop and stop not in cut.token_ids  # the engine's: not in token_ids
    want = [*cut.token_ids, stop]
    body = {"model": llm.model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    body |= {"stop_token_ids": [stop], "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert (r["prompt_token_ids"], r["token_ids"]) == (cut.prompt_token_ids, want)
    events = _sse(httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60))
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert choices[0]["prompt_token_ids"] == cut.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [i for c in choices for i in c["token_ids"]] == want
    plain = httpx.post(server.url + "/v1/completions", json={**body, "return_token_ids": False}, timeout=60)
    assert "token_ids" not in plain.json()["choices"][0]
    messages = [{"role": "user", "content": "Say something."}]
    chat_ref = llm.generate(llm.tokenizer.apply_chat_template(messages), max_tokens=8, temperature=0)
    chat = {"model": llm.model_name, "messages": messages, "max_tokens": 8, "temperature": 0}
    chat |= {"return_token_ids": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    ended = [chat_ref.end_token] if chat_ref.end_token is not None else []
    assert r["prompt_token_ids"] == chat_ref.prompt_token_ids
    assert r["choices"][0]["token_ids"] == [*chat_ref.token_ids, *ended]
    streamed = {**chat, "stream": True, "n": 2}  # greedy: both choices the same
    events = _sse(httpx.post(server.url + "/v1/chat/completions", json=streamed, timeout=60))
    for index in (0, 1):
        mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == chat_ref.prompt_token_ids
        assert all("prompt_token_ids" not in e for e in mine[1:])
        assert [i for e in mine for i in e["choices"][0]["token_ids"]] == [*chat_ref.token_ids, *ended]


def test_server_default_of_tokens_as_token_ids(llm):
    """`lumo serve --return-tokens-as-token-ids` (create_app's return_tokens_as_token_ids): the default of
    requests that do not say; one that says false gets the tokens' text."""
    from fastapi.testclient import TestClient

    from lumo.server.app import create_app

    body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "logprobs": 1}
    with TestClient(create_app(llm, return_tokens_as_token_ids=True)) as c:
        tokens = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens)
        off = c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        texts = off["choices"][0]["logprobs"]["tokens"]
        assert texts == [llm.tokenizer.token_text(int(t.split(":")[1])) for t in tokens]


def test_serve_flag_for_tokens_as_token_ids(ckpt):
    """`lumo serve --return-tokens-as-token-ids` reaches the app: logprobs name tokens by id."""
    with serve_subprocess(ckpt, "--device", "cpu", "--return-tokens-as-token-ids", env=ONE_THREAD) as s:
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "logprobs": 0}
        tokens = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
        assert len(tokens["tokens"]) == 3 and all(t.startswith("token_id:") for t in tokens["tokens"])


def test_return_tokens_as_token_ids(client, llm):
    """vLLM's return_tokens_as_token_ids: logprobs name tokens `token_id:N` (completions' tokens and
    top_logprobs keys, chat's tokens and alternatives, streamed and not); chat's bytes stay the token's."""
    ref = llm.generate("Hello there", max_tokens=6, temperature=0, logprobs=2)
    named = [f"token_id:{i}" for i in ref.token_ids]
    extra = {"return_tokens_as_token_ids": True}
    kw = dict(model=llm.model_name, prompt="Hello there", max_tokens=6, temperature=0, logprobs=2)
    lp = client.completions.create(**kw, extra_body=extra).choices[0].logprobs
    assert lp.tokens == named
    assert [set(top) for top in lp.top_logprobs] == [
        {f"token_id:{i}" for i, _ in t.top} | {f"token_id:{t.token}"} for t in ref.logprobs
    ]
    streamed = client.completions.create(**kw, extra_body=extra, stream=True)
    assert [
        x for e in streamed if e.choices and e.choices[0].logprobs for x in e.choices[0].logprobs.tokens
    ] == named
    messages = [{"role": "user", "content": "Say something."}]
    chat_ref = llm.generate(
        llm.tokenizer.apply_chat_template(messages), max_tokens=6, temperature=0, logprobs=2
    )
    ckw = dict(
        model=llm.model_name, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    for stream in (False, True):
        r = client.chat.completions.create(**ckw, extra_body=extra, stream=stream)
        entries = (
            [e for ev in r if ev.choices and ev.choices[0].logprobs for e in ev.choices[0].logprobs.content]
            if stream
            else r.choices[0].logprobs.content
        )
        assert [e.token for e in entries] == [f"token_id:{i}" for i in chat_ref.token_ids]
        assert [bytes(e.bytes) for e in entries] == [llm.tokenizer.token_bytes(i) for i in chat_ref.token_ids]
        assert [[x.token for x in e.top_logprobs] for e in entries] == [
            [f"token_id:{i}" for i, _ in t.top] for t in chat_ref.logprobs
        ]


def test_a_batch_of_prompts_is_each_prompt_alone(client, server, llm):
    """A completions request with several prompts (strings or token-id lists, as evaluation harnesses send
    them) answers choice i for prompt i, each what the prompt gets alone; streamed, each chunk carries its
    prompt's index; usage adds up."""
    prompts = ["The quick brown fox", "Hello", "def f(x):"]
    ids = llm.tokenizer.encode(prompts[1])
    alone = [llm.generate(p, max_tokens=5, temperature=0) for p in prompts]
    r = client.completions.create(model=llm.model_name, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.text for a in alone]
    assert r.usage.prompt_tokens == sum(len(a.prompt_token_ids) for a in alone)
    assert r.usage.completion_tokens == sum(generated(a) for a in alone)
    body = {"prompt": [ids, ids], "max_tokens": 5, "temperature": 0, "logprobs": 1}
    choices = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    assert [c["text"] for c in choices] == [alone[1].text] * 2
    assert choices[0]["logprobs"] == choices[1]["logprobs"]
    events = client.completions.create(
        model=llm.model_name, prompt=prompts, max_tokens=5, temperature=0, stream=True
    )
    texts = ["", "", ""]
    reasons = []
    for e in events:
        for c in e.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons.append((c.index, c.finish_reason))
    assert texts == [a.text for a in alone]
    assert [i for i, _ in reasons] == [0, 1, 2]


def test_penalties_and_min_p_are_the_engines(client, llm):
    """The penalties and min_p through both endpoints: the same tokens as LLM.generate with the same
    settings, which differ from the unpenalised ones (a negative presence penalty: the random model's flat
    logits barely notice a positive one)."""
    kw = {"max_tokens": 12, "temperature": 0.8, "top_p": 0.95, "seed": 4}
    shaped = {"presence_penalty": -1.5, "frequency_penalty": 0.5, "min_p": 0.05}
    want = llm.generate("The quick brown fox", **kw, **shaped, repetition_penalty=1.2)
    assert want.token_ids != llm.generate("The quick brown fox", **kw).token_ids
    extra = {"min_p": 0.05, "repetition_penalty": 1.2}  # vLLM's extensions: openai's extra_body
    r = client.completions.create(
        model=llm.model_name,
        prompt="The quick brown fox",
        presence_penalty=-1.5,
        frequency_penalty=0.5,
        extra_body=extra,
        **kw,
    )
    assert r.choices[0].text == want.text
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    want = llm.generate(prompt, **kw, **shaped, repetition_penalty=1.2)
    chat = client.chat.completions.create(
        model=llm.model_name,
        messages=messages,
        presence_penalty=-1.5,
        frequency_penalty=0.5,
        extra_body=extra,
        **kw,
    )
    assert chat.choices[0].message.content == _parsed(prompt, want.text)[0]


def test_logit_bias_is_the_engines(client, llm):
    """logit_bias (OpenAI's token-id-string keys) through both endpoints: LLM.generate's tokens with the same
    bias, values clamped to [-100, 100] as OpenAI / vLLM; a ban moves a greedy continuation off its first
    token, a large bias forces one."""
    kw = {"max_tokens": 8, "temperature": 0}
    plain = llm.generate("The quick brown fox", **kw).token_ids
    forced = (plain[1] + 7) % llm.config.vocab_size
    sent = {str(plain[0]): -100, str(forced): 250.0}  # 250: clamped to 100
    want = llm.generate("The quick brown fox", **kw, logit_bias={plain[0]: -100, forced: 100})
    assert want.token_ids[0] == forced and plain[0] not in want.token_ids
    r = client.completions.create(model=llm.model_name, prompt="The quick brown fox", logit_bias=sent, **kw)
    assert r.choices[0].text == want.text
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    first = llm.generate(prompt, **kw).token_ids[0]
    want = llm.generate(prompt, **kw, logit_bias={first: -100})
    chat = client.chat.completions.create(
        model=llm.model_name, messages=messages, logit_bias={str(first): -100}, **kw
    )
    assert chat.choices[0].message.content == _parsed(prompt, want.text)[0]
    assert want.token_ids[0] != first
    # vLLM's ignore_eos (extra_body): an end token forced to the top ends a request, or is generated on
    eos = {str(llm.tokenizer.eos_token_ids[0]): 100}
    ended = client.completions.create(model=llm.model_name, prompt="Hi", logit_bias=eos, **kw)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1  # the end token
    kept = client.completions.create(
        model=llm.model_name, prompt="Hi", logit_bias=eos, extra_body={"ignore_eos": True}, **kw
    )
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 8
    late = client.completions.create(
        model=llm.model_name, prompt="Hi", logit_bias=eos, extra_body={"min_tokens": 5}, **kw
    )  # vLLM's min_tokens: no end token before the 5th
    assert late.choices[0].finish_reason == "stop" and late.usage.completion_tokens == 6
    streamed = client.chat.completions.create(
        model=llm.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        logit_bias=eos,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    events = list(streamed)
    assert events[-1].usage.completion_tokens == 8
    assert [c.finish_reason for e in events for c in e.choices if c.finish_reason] == ["length"]


def test_reasoning_opened_by_a_continued_message():
    """The output starts as reasoning when the template ends the prompt with <think>, or when the message
    continue_final_message continues opened <think> without closing it."""
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\nSure", "Sure")
    assert opens_reasoning("<|im_start|>assistant\n<think>\nThe user says hi", "<think>\nThe user says hi")
    assert not opens_reasoning("x<think>a</think>b", "<think>a</think>b")


def test_tokenize_and_detokenize(server, llm):
    """vLLM's /tokenize (a prompt; chat messages as the chat endpoint renders them) and /detokenize."""
    tok = llm.tokenizer
    r = httpx.post(
        server.url + "/tokenize", json={"prompt": "The quick brown fox", "return_token_strs": True}
    )
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("The quick brown fox")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == llm.max_model_len
    assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]]
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages)) and chat["token_strs"] is None
    bare = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False})
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert bare.json()["tokens"] == tok.encode(rendered) != chat["tokens"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": "The quick brown fox"}


def test_continue_final_message(client, server, llm):
    """vLLM's continue_final_message: the last (assistant) message is continued, not answered: the prompt
    is the template's text up to its end (as /tokenize shows), and the output LLM.generate's on it."""
    tok = llm.tokenizer
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("One, two,")
    want = llm.generate(prompt, max_tokens=6, temperature=0)
    extra = {"continue_final_message": True}
    r = client.chat.completions.create(
        model=llm.model_name, messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )
    assert r.choices[0].message.content == _parsed(prompt, want.text)[0]
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    shown = httpx.post(server.url + "/tokenize", json={"messages": messages, **extra}).json()
    assert shown["tokens"] == tok.encode(prompt)


def test_stop_token_ids_include_stop_str_and_special_tokens(client, llm):
    """vLLM's output options: stop_token_ids end a choice like an end-of-sequence token (not in the text),
    include_stop_str_in_output keeps the stop string, skip_special_tokens false shows special tokens (an
    end token generated under ignore_eos)."""
    kw, prompt = {"max_tokens": 10, "temperature": 0}, "Hello, how are you?"
    plain = llm.generate(prompt, **kw)
    assert len(plain.token_ids) == 10, "the random model should not end this prompt early"
    j = next(i for i in range(2, 10) if plain.token_ids[i] not in plain.token_ids[:i])
    want = llm.generate(prompt, **kw, stop_token_ids=[plain.token_ids[j]])
    assert want.token_ids == plain.token_ids[:j] and want.finish_reason == "stop"
    extra = {"stop_token_ids": [plain.token_ids[j]]}
    r = client.completions.create(model=llm.model_name, prompt=prompt, extra_body=extra, **kw)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == j + 1  # the stop token counted, as vLLM counts it
    stop = next(s for i in range(3, 9) if "\ufffd" not in (s := plain.text[i : i + 2]))
    cut = llm.generate(prompt, **kw, stop=[stop])
    kept = llm.generate(prompt, **kw, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == cut.text + stop and cut.finish_reason == kept.finish_reason == "stop"
    extra = {"include_stop_str_in_output": True}
    r = client.completions.create(model=llm.model_name, prompt=prompt, stop=[stop], extra_body=extra, **kw)
    assert r.choices[0].text == kept.text
    eos = llm.tokenizer.eos_token_ids[0]
    shown = {"logit_bias": {str(eos): 100}, "ignore_eos": True, "skip_special_tokens": False}
    r = client.completions.create(model=llm.model_name, prompt="Hi", max_tokens=2, extra_body=shown)
    assert r.choices[0].text == llm.tokenizer.decode([eos, eos]) != ""


def test_n_choices_are_the_seeded_requests_in_turn(client, server, llm):
    """n > 1: choice j samples with seed + j (choice 0 is the request alone), completions prompt-major over a
    batch, chat and completions, streamed and not; usage counts each prompt once and every choice's tokens;
    greedy choices are identical."""
    kw = {"max_tokens": 8, "temperature": 0.9, "top_p": 0.95}
    prompts = ["The quick brown fox", "def f(x):"]
    alone = [[llm.generate(p, seed=11 + j, **kw) for j in range(3)] for p in prompts]
    assert len({a.text for a in alone[0]}) > 1, "the seeds should give different samples"
    r = client.completions.create(model=llm.model_name, prompt=prompts, n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [a.text for row in alone for a in row]
    assert r.usage.prompt_tokens == sum(len(row[0].prompt_token_ids) for row in alone)
    assert r.usage.completion_tokens == sum(generated(a) for row in alone for a in row)
    texts = [""] * 6
    usage = {"include_usage": True}
    events = list(
        client.completions.create(
            model=llm.model_name, prompt=prompts, n=3, seed=11, stream=True, stream_options=usage, **kw
        )
    )
    for e in events:
        for c in e.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices] and events[-1].usage == r.usage

    messages = [{"role": "user", "content": "Hello, how are you?"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    want = [_parsed(prompt, llm.generate(prompt, seed=5 + j, **kw).text)[0] for j in range(2)]
    chat = client.chat.completions.create(model=llm.model_name, messages=messages, n=2, seed=5, **kw)
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == want
    assert chat.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    streamed = ["", ""]
    roles = []
    chat_kw = {"model": llm.model_name, "messages": messages, "n": 2}
    for e in client.chat.completions.create(**chat_kw, seed=5, stream=True, **kw):
        for c in e.choices:
            streamed[c.index] += c.delta.content or ""
            roles += [c.index] if c.delta.role else []
    assert streamed == want and roles == [0, 1]
    greedy = client.chat.completions.create(**chat_kw, max_tokens=6, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
