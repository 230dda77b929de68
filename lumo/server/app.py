"""The OpenAI-compatible HTTP server: FastAPI routes over one engine worker.

POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (each also as SSE with `stream: true`;
GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel),
POST /v1/messages and /v1/messages/count_tokens (Anthropic's), GET /v1/models and /v1/models/{id},
GET /health and /ping, GET /version, GET /metrics (Prometheus text), POST /tokenize and /detokenize
(vLLM's). See docs/server.md.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from .. import __version__
from ..engine.grammar import StructuredOutputs
from ..tokenizer import IncrementalDetokenizer, TokenizerError
from .anthropic import CountTokensRequest, MessageBuilder, MessagesRequest
from .anthropic import stop_reason as anthropic_stop_reason
from .anthropic import usage as anthropic_usage
from .chat import (
    continued_text,
    delta_json,
    finish_reason,
    forced_tool_calls,
    message_json,
    opens_reasoning,
    render_prompt,
)
from .errors import APIError, anthropic_error, error_response, install_error_handlers
from .logprobs import chat_entries, completion_logprobs, extend, prompt_entries
from .metrics import ServerMetrics, add_vllm_names
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses import (
    InputTokensRequest,
    ItemStore,
    ResponseBuilder,
    ResponsesRequest,
    ResponseStore,
    response_head,
    response_usage,
)
from .toolparse import ChatOutputParser
from .worker import EngineWorker, Job, Ticket

ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/health",
    "/ping",
    "/version",
    "/metrics",
    "/tokenize",
    "/detokenize",
)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
# A prompt of more than context x longest-token characters x this is refused without tokenising it (the
# slack covers normalisation that merges characters, e.g. NFC composing combining marks).
PROMPT_CHARS_SLACK = 4
DISCONNECT_POLL_S = 0.2
PING_S = 10.0  # an Anthropic stream's keep-alive while it waits for tokens


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event(obj: dict[str, Any]) -> str:
    """A Responses API server-sent event: its type as the SSE event name, the object as data."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(n_prompt: int, n_gen: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_gen,
        "total_tokens": n_prompt + n_gen,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _check_min_tokens(body: Any, budget: int) -> None:
    """min_tokens within the tokens the request may generate (the default limit or the context's room
    included), as a 400 naming it rather than the engine's error."""
    if body.min_tokens and body.min_tokens > budget:
        msg = f"min_tokens {body.min_tokens} exceeds the {budget} tokens this request may generate"
        raise APIError(400, msg, "min_tokens")


async def _with_pings(items: AsyncIterator[Any], every: float) -> AsyncIterator[Any]:
    """`items`, with a None after each `every` seconds in which none came."""
    it = aiter(items)
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = nxt or asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({nxt}, timeout=every)
            if not done:
                yield None
                continue
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield item
    finally:
        if nxt is not None:
            nxt.cancel()


async def _guarded(
    events: AsyncIterator[str], jobs: list[Job], failed: Callable[[APIError], list[str]]
) -> AsyncIterator[str]:
    """A stream of events of its own (Responses, Anthropic): an engine error ends it with `failed`'s
    events, and its jobs are cancelled however it ends (a client gone mid-stream included)."""
    try:
        async for e in events:
            yield e
    except Exception as exc:
        for e in failed(_engine_error(exc)):
            yield e
    finally:
        for job in jobs:
            job.cancel()


def _response_failed(build: ResponseBuilder, err: APIError) -> list[str]:
    """A Responses stream's end on an error: `error`, then `response.failed` carrying its code."""
    code = err.code or ("server_error" if err.status >= 500 else "invalid_request")
    response = build.response("failed")
    response["error"] = {"code": code, "message": err.message}
    return [
        _event(build.event("error", code=code, message=err.message, param=err.param)),
        _event(build.event("response.failed", response=response)),
    ]


async def _listed(items: list[str]) -> AsyncIterator[str]:
    for item in items:
        yield item


def _engine_error(exc: Exception) -> APIError:
    # ValueError from the engine (PromptTooLongError among them) is about the request; anything else is ours
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}")


class _CountRequests:
    """ASGI middleware: lumo_requests_total{endpoint, status}, streaming responses included."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.inc(endpoint=endpoint, status=str(status))


class _RequireKey:
    """ASGI middleware (`lumo serve --api-key`): every route but the probes (/health, /ping), /version and
    /metrics answers only requests carrying `Authorization: Bearer <key>` (what OpenAI clients send for
    their api_key) or `x-api-key: <key>` (Anthropic's clients); others get a 401."""

    OPEN = ("/health", "/ping", "/version", "/metrics")  # probes, scrapers and the version, as in vLLM

    def __init__(self, app: Any, key: str) -> None:
        self.app, self._key = app, key.strip().encode()  # a key from an env file may end in a newline
        if not self._key:
            raise ValueError("the API key is empty")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        msg = "invalid or missing API key (send Authorization: Bearer <key>, or x-api-key: <key>)"
        headers = {"WWW-Authenticate": "Bearer"}
        response = error_response(scope["path"], 401, msg, code="invalid_api_key", headers=headers)
        await response(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return bearer or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self._key)  # not empty


@dataclass
class _Collected:
    """A non-streamed job's output (_Server._collect)."""

    text: str = ""
    n_gen: int = 0  # tokens generated, with an end token that ended the output (as vLLM counts)
    reason: str | None = None  # the finish reason
    logprobs: list = field(default_factory=list)  # the tokens' (empty unless the job asked)
    why: Any = None  # vLLM's stop_reason: the stop string or stop token id that ended it, else None
    prompt_logprobs: list = field(default_factory=list)  # the prompt's (empty unless asked)
    token_ids: list[int] = field(default_factory=list)  # _chunk_ids of every chunk


def _chunk_ids(chunk: Any) -> list[int]:
    """A chunk's token ids as vLLM's `token_ids` give them: the end-of-sequence or stop token that ended the
    output included (it is in the sequence the model produced, though not in the text)."""
    end = getattr(chunk, "end_token", None)
    return [*chunk.token_ids, *([end] if end is not None else [])]


def chunk_logprobs(chunk: Any) -> list:
    """A chunk's token logprobs, and the end-of-sequence token's when it ended the output (an engine
    without logprobs: none)."""
    eos = getattr(chunk, "eos_logprob", None)
    return [*(getattr(chunk, "logprobs", None) or []), *([eos] if eos is not None else [])]


class _CompletionOutput:
    """A completion job's chunks as the completions API's text and logprobs pieces: with echo, the prompt
    (and its tokens' logprobs) first; with max_tokens 0, nothing generated (the prompt only scored). The
    logprobs cover an end-of-sequence token that ended the output (not in the text), as vLLM's do: a
    harness that drops the last entry of an echoed one-token completion keeps the prompt's whole."""

    def __init__(
        self,
        tok: Any,
        job: Job,
        prompt_ids: list[int],
        echo: str | None,
        score_only: bool,
        as_ids: bool = False,
        prompt_k: int | None = None,
    ):
        """as_ids: tokens named by id (return_tokens_as_token_ids). prompt_k: the alternatives of vLLM's
        prompt_logprobs, whose entries are in `prompt_logprobs` after the first chunk (None: not wanted;
        `prompt_logprobs` stays None)."""
        self.tok, self.job, self.prompt_ids, self.echo = tok, job, prompt_ids, echo
        self.score_only, self.as_ids, self.prompt_k = score_only, as_ids, prompt_k
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None
        self.n_prompt, self.n_gen, self.first = len(prompt_ids), 0, True
        self.new_ids: list[int] = []  # the latest chunk's generated ids, its end token included (_chunk_ids)
        # text_offset: where each token's text starts, by the engine's own incremental detokenisation
        self.pos = 0
        skip = job.sampling.get("skip_special_tokens", True)  # the engine's text: the same setting
        self.detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids[-8:], skip_special_tokens=skip)

    def _offsets(self, ids: list[int], detok: IncrementalDetokenizer) -> list[int]:
        """Where each token's text starts: a whole token's own text ends what its decode adds (text held
        back before it, an earlier token's incomplete bytes, comes first); a token holding part of a
        character is placed where that character starts."""
        out = []
        for i in ids:
            piece, own = detok.add(i), self.tok.token_text(i)
            whole = own and "\ufffd" not in own and piece.endswith(own)
            out.append(self.pos + len(piece) - len(own) if whole else self.pos)
            self.pos += len(piece)
        return out

    def take(self, chunk: Any) -> tuple[str, dict[str, Any] | None]:
        text, ids, lps = chunk.text, chunk.token_ids, chunk_logprobs(chunk)
        if len(lps) > len(ids):  # the end-of-sequence token's entry
            ids = [*ids, lps[-1].token]
        if self.score_only:
            text, ids, lps = "", [], []
        self.n_gen += len(_chunk_ids(chunk)) if not self.score_only else 0
        self.new_ids = [] if self.score_only else _chunk_ids(chunk)
        offsets = []
        if self.first:
            self.first = False
            scored = getattr(chunk, "prompt_logprobs", None) or []
            if self.prompt_k is not None:
                self.prompt_logprobs = prompt_entries(self.tok, scored, self.prompt_k)
            if self.echo is not None:
                text = self.echo + text
                if self.job.wants_logprobs:  # the echoed text is the prompt's decode, specials included
                    echo = IncrementalDetokenizer(self.tok, skip_special_tokens=False)
                    offsets = self._offsets(self.prompt_ids, echo)
                    self.pos = len(self.echo)  # the completion's text follows the echoed prompt
                k = self.job.sampling["logprobs"]  # the engine may have scored more for prompt_logprobs
                echoed = [t if t is None else replace(t, top=t.top[:k]) for t in scored]
                ids, lps = self.prompt_ids + ids, echoed + lps
        if not self.job.wants_logprobs:
            return text, None
        offsets += self._offsets(ids[len(offsets) :], self.detok)
        lps += [None] * (len(ids) - len(lps))  # an engine that scores nothing: null entries, not an error
        return text, completion_logprobs(self.tok, ids, lps, offsets, self.as_ids)

    def reason(self, engine_reason: str | None) -> str:
        return "length" if self.score_only else engine_reason or "length"


def _batch_usage(outs: list[_CompletionOutput], n: int = 1) -> dict[str, Any]:
    """`usage` of a completions request: every choice's tokens, each prompt's (and its cached tokens) once,
    from its first choice (outs: prompt-major, n choices per prompt)."""
    first = outs[::n]
    return _usage(
        sum(o.n_prompt for o in first), sum(o.n_gen for o in outs), sum(o.job.cached_tokens for o in first)
    )


def _running_usage(n_prompt: int, n_gen: int) -> dict[str, int]:
    """A chunk's usage under continuous_usage_stats (vLLM's: no prompt_tokens_details, whose cached count
    is the last chunk's, the request's)."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def _stream_usage(body: Any) -> tuple[bool, bool]:
    """A stream's usage: (include_usage: a last chunk with the request's, continuous_usage_stats as vLLM
    serves it: with include_usage, every chunk also carries its choice's usage so far)."""
    opts = body.stream_options
    final = bool(opts and opts.include_usage)
    return final, final and opts.continuous_usage_stats


async def _sse_stream(
    events: AsyncIterator[str],
    head: dict[str, Any],
    usage: Callable[[], dict[str, Any]] | None,
    latest_job: Callable[[], Job | None],
) -> AsyncIterator[str]:
    """A streamed response: its choices' events, the usage chunk (when asked), then [DONE]; an engine error
    as one error event and [DONE]. The latest job is cancelled at the end: a no-op after a normal end, it
    stops the engine when the client went away."""
    try:
        async for event in events:
            yield event
        if usage is not None:
            yield _sse({**head, "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"
    except Exception as exc:
        yield _sse(_engine_error(exc).body())
        yield "data: [DONE]\n\n"
    finally:
        job = latest_job()
        if job is not None:
            job.cancel()


class _Server:
    def __init__(
        self,
        llm: Any,
        served_name: str,
        worker: EngineWorker,
        metrics: ServerMetrics,
        tokens_as_ids: bool = False,
        aliases: Sequence[str] = (),
    ) -> None:
        self.llm, self.served_name, self.worker, self.metrics = llm, served_name, worker, metrics
        # the names requests may use (vLLM's several --served-model-name: the first answers)
        self.names = tuple(dict.fromkeys((served_name, *aliases)))
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids when a request does not say
        self.created = int(time.time())
        self.items = ItemStore()  # the Responses API's recent items, for item_reference
        self.kept = ResponseStore()  # its recent responses, for previous_response_id and GET / DELETE
        # background responses not yet ended: their jobs, tasks, and why a client stopped them (or None)
        self._running: dict[str, tuple[Job, asyncio.Task, str | None]] = {}

    # ---- small endpoints ----
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def version(self) -> dict[str, str]:
        """vLLM's GET /version: the server's version."""
        return {"version": __version__}

    def _card(self, name: str) -> dict[str, Any]:
        """The model as OpenAI's and Anthropic's model objects describe one (the fields of both)."""
        created = datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc)
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "lumo",
            "max_model_len": self.llm.max_model_len,
            "type": "model",
            "display_name": name,
            "created_at": created.isoformat().replace("+00:00", "Z"),
        }

    async def models(self) -> dict[str, Any]:
        cards = [self._card(name) for name in self.names]
        page = {"has_more": False, "first_id": cards[0]["id"], "last_id": cards[-1]["id"]}  # Anthropic's list
        return {"object": "list", "data": cards, **page}

    async def model(self, model_id: str, request: Request) -> dict[str, Any]:
        """GET /v1/models/{id}: the served model (OpenAI's SDK `models.retrieve`); under Anthropic's API
        (an `anthropic-version` header) any name, as /v1/messages answers any."""
        if model_id not in self.names and "anthropic-version" not in request.headers:
            raise APIError(
                404, f"model {model_id!r} not found; this server serves {self.served_name!r}", "model",
                "model_not_found",
            )  # fmt: skip
        return self._card(model_id)

    async def metrics_text(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.registry.render(), media_type="text/plain; version=0.0.4")

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the token ids the engine would see for a prompt or chat messages (to count
        them, or to find the ids logit_bias and stop_token_ids name)."""
        self._check_model(body.model)
        tok, chat = self.llm.tokenizer, body.chat()
        if chat is None:
            text, param = body.prompt, "prompt"
        else:
            text, param = await asyncio.to_thread(render_prompt, tok, chat), "messages"
        ids = await self._encode(text, param)
        strs = [tok.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.llm.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        self._check_model(body.model)
        tok = self.llm.tokenizer
        if any(not 0 <= t < tok.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must lie in [0, {tok.vocab_size})", "tokens")
        return {"prompt": tok.decode(body.tokens)}

    # ---- shared request plumbing ----
    def _as_ids(self, body: Any) -> bool:
        """Logprobs name tokens `token_id:N`: the request's return_tokens_as_token_ids, else the server's."""
        asked = body.return_tokens_as_token_ids
        return self.tokens_as_ids if asked is None else asked

    def _vocab_size(self) -> int:
        """The model's vocabulary size (its logits' width: the ids logit_bias and stop_token_ids name)."""
        return self.llm.config.vocab_size

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (*self.names, self.llm.model_name):
            raise APIError(
                404,
                f"model {model!r} not found; this server serves {self.served_name!r}",
                "model",
                "model_not_found",
            )

    def _budget(
        self, n_prompt: int, max_tokens: int | None, default: int | None, param: str, name: str = "max_tokens"
    ) -> int:
        """The tokens a request may generate: its `name` (max_tokens, or the API's own name for it), checked
        to fit the context with the prompt, or what the context leaves."""
        limit = self.llm.max_model_len
        room = limit - n_prompt
        # OpenAI's wording (vLLM's too), which clients look for (LiteLLM's ContextWindowExceededError)
        if room < 1:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{n_prompt} input tokens (the input and 1 new token must fit). Please reduce the input."
            )
            raise APIError(400, msg, param, "context_length_exceeded")
        if max_tokens is None:
            return room if default is None else min(default, room)
        if max_tokens > room:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens + n_prompt} tokens ({n_prompt} in the input, {max_tokens} for {name}): at "
                f"most {room} new tokens fit. Please reduce the input or {name}."
            )
            raise APIError(400, msg, name, "context_length_exceeded")
        return max_tokens

    async def _encode(self, text: str, param: str, truncating: bool = False) -> list[int]:
        """A prompt's token ids, tokenised in a worker thread. A text far longer than the context could
        hold is refused at once (unless the request truncates it), and text that is not valid Unicode is
        a 400."""
        tok, limit = self.llm.tokenizer, self.llm.max_model_len
        if not truncating and len(text) > PROMPT_CHARS_SLACK * limit * tok.max_token_chars:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, the input has {len(text)} "
                "characters, far more than that holds. Please reduce the input."
            )
            raise APIError(400, msg, param, "context_length_exceeded")
        try:
            return await run_in_threadpool(tok.encode, text)
        except TokenizerError as e:
            raise APIError(400, str(e), param) from None

    async def _structured(self, body: Any) -> StructuredOutputs | None:
        """The request's structured output (None: none): its own field's, or the tool calls a chat request's
        tool_choice forces (chat.forced_tool_calls). Its grammar is compiled for this tokenizer before the
        request is queued (else a 400 naming the field), off the event loop (a large schema takes up to a
        second; the compiled grammar is cached for the request's run)."""
        structured, field = body.structured(), body.structured_field
        forced = (
            forced_tool_calls(self.llm.tokenizer, body) if isinstance(body, ChatCompletionRequest) else None
        )
        if forced is not None:
            if structured is not None:
                msg = f"a tool_choice that forces a call cannot be combined with {field}"
                raise APIError(400, msg, "tool_choice")
            structured, field = forced, "tool_choice"
        if structured is None:
            return None
        # the grammar may allow only the end token before min_tokens, which the ban would refuse
        if body.min_tokens:
            raise APIError(400, f"min_tokens cannot be combined with {field}", "min_tokens")
        try:
            await asyncio.to_thread(self.llm.constraint, structured, [])
        except ValueError as e:
            raise APIError(400, str(e), field) from None
        return structured

    def _submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: dict[str, Any],
        ticket: Ticket,
        scores_only: bool = False,
    ) -> Job:
        """Queue one of an admitted request's jobs (EngineWorker.submit)."""
        job = Job(prompt_ids, max_tokens, sampling, asyncio.get_running_loop(), scores_only=scores_only)
        return self.worker.submit(job, ticket)

    async def _collected(self, job: Job, request: Request | None) -> AsyncIterator[Any]:
        """A non-streamed job's chunks; a client that hangs up cancels it (request None: a background job,
        no client), an engine error is an APIError."""

        async def watch() -> None:
            while not job.cancelled.is_set():
                await asyncio.sleep(DISCONNECT_POLL_S)
                if await request.is_disconnected():
                    job.cancel()

        watcher = None if request is None else asyncio.create_task(watch())
        try:
            async for chunk in job.events():
                yield chunk
        except Exception as exc:
            raise _engine_error(exc) from None
        finally:
            if watcher is not None:
                watcher.cancel()
            job.cancel()

    async def _collect(self, job: Job, request: Request | None) -> _Collected:
        """Run a non-streamed job to its end."""
        out = _Collected()
        parts = []
        async for chunk in self._collected(job, request):
            out.prompt_logprobs = out.prompt_logprobs or getattr(chunk, "prompt_logprobs", None) or []
            parts.append(chunk.text)
            out.token_ids += _chunk_ids(chunk)
            out.n_gen += len(_chunk_ids(chunk))
            out.reason = chunk.finish_reason or out.reason
            out.why = getattr(chunk, "stop_reason", None) if chunk.finish_reason else out.why
            if job.wants_logprobs:
                out.logprobs += chunk_logprobs(chunk)
        out.text = "".join(parts)
        return out

    # ---- /v1/completions ----
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        body.check_supported()
        by_id = body.token_settings(self._vocab_size)  # logit_bias, stop_token_ids
        tok = self.llm.tokenizer
        prompts = body.prompts()
        # max_tokens 0 (with echo): one token is generated (the prefill samples it anyway) and dropped
        score_only = body.max_tokens == 0
        want = 1 if score_only else body.max_tokens
        structured = await self._structured(body)  # one grammar for every prompt
        items = []  # every prompt checked before the first one runs
        truncating = body.truncate_prompt_tokens is not None
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = await self._encode(prompt, param, truncating)
            else:
                vocab = min(tok.vocab_size, self._vocab_size())  # ids the tokenizer decodes, the model embeds
                if any(t < 0 or t >= vocab for t in prompt):
                    raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param)
                ids = list(prompt)
            room = COMPLETION_DEFAULT_MAX_TOKENS if want is None else want
            kept = body.truncated(ids, room, self.llm.max_model_len)
            budget = self._budget(len(kept), want, COMPLETION_DEFAULT_MAX_TOKENS, param)
            _check_min_tokens(body, budget)
            echo = None
            if body.echo:  # the prompt the model saw
                echo = prompt if isinstance(prompt, str) and len(kept) == len(ids) else tok.decode(kept)
            items.append((kept, budget, echo))
        n = body.choices

        ticket = self.worker.admit()  # a 503 now, or a place held for the first job

        def start(c: int) -> _CompletionOutput:
            """Choice c's job (prompt c // n, its choice c % n), queued when its turn comes: a request holds
            one place in the queue at a time."""
            ids, budget, echo = items[c // n]
            sampling = {**body.sampling(c % n), **by_id, "structured_outputs": structured}
            job = self._submit(ids, budget, sampling, ticket, scores_only=score_only)
            shown = None if body.stream else body.shown_prompt_logprobs()  # a stream does not carry them
            return _CompletionOutput(tok, job, ids, echo, score_only, self._as_ids(body), shown)

        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.served_name}
        with_ids = bool(body.return_token_ids)
        if body.stream:
            events = self._stream_completion(start, len(items) * n, n, head, *_stream_usage(body), with_ids)
            return self._streaming(events)
        choices, outs, scored = [], [], None
        for i in range(len(items) * n):
            if i and await request.is_disconnected():
                break  # the client went away: the rest of the batch would go unread
            out = start(i)
            outs.append(out)
            text, logprobs, reason, why, ids = "", None, None, None, []
            async for chunk in self._collected(out.job, request):
                piece, lp = out.take(chunk)
                text, logprobs = text + piece, extend(logprobs, lp)
                if with_ids:
                    ids += out.new_ids
                reason = chunk.finish_reason or reason
                why = getattr(chunk, "stop_reason", None) if chunk.finish_reason else why
            # vLLM's prompt_logprobs on every choice (null unless asked, or echo with logprobs), scored by
            # the prompt's first choice
            scored = out.prompt_logprobs if i % n == 0 else scored
            choice = {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": out.reason(reason),
                "stop_reason": None if out.score_only else why,  # vLLM's: the stop string or token id
                "prompt_logprobs": scored,
            }
            if with_ids:  # vLLM's return_token_ids
                choice |= {"prompt_token_ids": out.prompt_ids, "token_ids": ids}
            choices.append(choice)
        return {**head, "choices": choices, "usage": _batch_usage(outs, n)}

    async def _stream_completion(
        self,
        start: Callable[[int], _CompletionOutput],
        count: int,
        n: int,
        head: dict[str, Any],
        include_usage: bool,
        continuous: bool = False,
        with_ids: bool = False,
    ) -> AsyncIterator[str]:
        """The choices' chunks in turn, each under its index (prompt-major, n choices per prompt). with_ids
        (vLLM's return_token_ids): a choice's first chunk carries the prompt's ids, every chunk the ids of
        its tokens. continuous (_stream_usage): each chunk its choice's usage so far."""
        extra = {"usage": None} if include_usage else {}
        outs = []

        async def choices() -> AsyncIterator[str]:
            for i in range(count):
                out = start(i)
                outs.append(out)
                reason, held, sent = None, [], False  # held: token ids not yet sent (with_ids)

                def event(choice: dict[str, Any], out: _CompletionOutput = out) -> str:
                    """A chunk of the choice, with its token ids (the prompt's on the choice's first)."""
                    nonlocal held, sent
                    if with_ids:
                        choice["token_ids"], held = held, []
                        if not sent:
                            choice["prompt_token_ids"] = out.prompt_ids
                    sent = True
                    if continuous:
                        usage = _running_usage(out.n_prompt, out.n_gen)
                        return _sse({**head, "choices": [choice], "usage": usage})
                    return _sse({**head, "choices": [choice], **extra})

                async for chunk in out.job.events():
                    reason = chunk.finish_reason or reason
                    text, logprobs = out.take(chunk)
                    held += out.new_ids
                    if text or chunk.finish_reason or logprobs:
                        choice = {
                            "index": i,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": chunk.finish_reason and out.reason(chunk.finish_reason),
                        }
                        if chunk.finish_reason:  # vLLM's stop_reason, on the chunk that finishes the choice
                            why = None if out.score_only else getattr(chunk, "stop_reason", None)
                            choice["stop_reason"] = why
                        yield event(choice)
                if reason is None:
                    yield event({"index": i, "text": "", "logprobs": None, "finish_reason": "length"})

        usage = (lambda: _batch_usage(outs, n)) if include_usage else None
        async for event in _sse_stream(choices(), head, usage, lambda: outs[-1].job if outs else None):
            yield event

    # ---- /v1/chat/completions ----
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        body.check_supported()
        by_id = body.token_settings(self._vocab_size)  # logit_bias, stop_token_ids
        tok = self.llm.tokenizer
        prompt = await asyncio.to_thread(render_prompt, tok, body)  # a long chat takes a while: off the loop
        truncating = body.truncate_prompt_tokens is not None
        prompt_ids = await self._encode(prompt, "messages", truncating)
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        kept = body.truncated(prompt_ids, body.max_new_tokens(), self.llm.max_model_len, name)
        continued = continued_text(body)
        if body.truncation_side == "right" and len(kept) < len(prompt_ids):
            prompt, continued = tok.decode(kept), None  # the output continues the cut prompt (reasoning?)
        prompt_ids = kept
        max_tokens = self._budget(len(prompt_ids), body.max_new_tokens(), None, "messages", name)
        _check_min_tokens(body, max_tokens)
        structured = await self._structured(body)
        tools = body.template_tools()

        ticket = self.worker.admit()  # a 503 now, or a place held for the first job

        def start(j: int) -> tuple[Job, ChatOutputParser]:
            """Choice j's job and output parser, queued when its turn comes (one place in the queue)."""
            sampling = {**body.sampling(j), **by_id, "structured_outputs": structured}
            job = self._submit(prompt_ids, max_tokens, sampling, ticket)
            parser = ChatOutputParser(
                in_reasoning=opens_reasoning(prompt, continued),
                parse_tools=body.parse_tools,
                tools=tools,
                reasoning=body.include_reasoning is not False,
                custom=body.custom_tools(),
            )
            return job, parser

        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.served_name}
        as_ids = self._as_ids(body)
        ids = prompt_ids if body.return_token_ids else None  # vLLM's return_token_ids
        if body.stream:
            head["object"] = "chat.completion.chunk"
            usage = _stream_usage(body)
            events = self._stream_chat(start, body.choices, head, len(prompt_ids), usage, as_ids, ids)
            return self._streaming(events)
        choices, n_gen, cached, scored = [], 0, 0, None
        for j in range(body.choices):
            if j and await request.is_disconnected():
                break
            job, parser = start(j)
            out = await self._collect(job, request)
            parsed = parser.feed(out.text)
            parsed.extend(parser.finish(cut=out.reason == "length"))
            if j == 0 and body.prompt_logprobs is not None:
                scored = prompt_entries(tok, out.prompt_logprobs, body.prompt_logprobs)
            logprobs = None
            if job.wants_logprobs:
                logprobs = {"content": chat_entries(tok, out.logprobs, as_ids), "refusal": None}
            choice = {
                "index": j,
                "message": message_json(parsed, parser.reasoned),
                "logprobs": logprobs,
                "finish_reason": finish_reason(out.reason, parser.n_tool_calls),
                "stop_reason": out.why,
            }
            if ids is not None:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
            n_gen, cached = n_gen + out.n_gen, cached if j else job.cached_tokens  # the prompt's, choice 0's
        extra = {"prompt_logprobs": scored}  # vLLM's, at the top level (null unless asked)
        if ids is not None:
            extra["prompt_token_ids"] = ids
        return {**head, "choices": choices, "usage": _usage(len(prompt_ids), n_gen, cached), **extra}

    # ---- /v1/responses ----
    def _responses_chat(self, body: ResponsesRequest) -> ChatCompletionRequest:
        """The request as a chat request: its item references resolved, after the conversation its
        previous_response_id continues."""
        previous = body.previous_response_id
        return body.to_chat(self.items, None if previous is None else self.kept.history(previous))

    async def responses(self, body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API over the chat machinery (lumo/server/responses.py); any model name (as
        /v1/messages: an agent's configured model, Codex CLI's review model). Streamed, a conversation past
        the context is a `response.failed` with code context_length_exceeded (what Codex CLI looks for before
        it compacts the conversation), not an HTTP 400."""
        chat = self._responses_chat(body)  # checked (check_supported), errors name the request's own items
        by_id = chat.token_settings(self._vocab_size)
        tok = self.llm.tokenizer
        prompt = await asyncio.to_thread(render_prompt, tok, chat)
        build = ResponseBuilder(response_head(body, self.served_name), body.tool_names)
        try:
            prompt_ids = await self._encode(prompt, "input")
            max_tokens = self._budget(len(prompt_ids), chat.max_tokens, None, "input", "max_output_tokens")
            structured = await self._structured(chat)
        except APIError as e:  # the chat field's name -> the Responses one
            e.param = {"max_tokens": "max_output_tokens", "response_format": "text"}.get(e.param, e.param)
            if body.stream and e.code == "context_length_exceeded" and e.param == "input":
                created = build.event("response.created", response=build.response("in_progress"))
                return self._streaming(_listed([_event(created), *_response_failed(build, e)]))
            raise
        tools = chat.template_tools()
        parser = ChatOutputParser(
            in_reasoning=opens_reasoning(prompt),
            parse_tools=chat.parse_tools,
            tools=tools,
            custom=chat.custom_tools(),
        )
        ticket = self.worker.admit()  # a 503 now, or a place held for the job

        def submit() -> Job:
            sampling = {**chat.sampling(0), **by_id, "structured_outputs": structured}
            return self._submit(prompt_ids, max_tokens, sampling, ticket)

        def result(job: Job, n_gen: int, reason: str | None, reasoning: str) -> tuple[str, dict]:
            """The terminal status and response after the last item closed."""
            status, why = ("incomplete", "max_output_tokens") if reason == "length" else ("completed", None)
            n_reasoning = len(tok.encode(reasoning, check=False)) if reasoning else 0
            usage = response_usage(len(prompt_ids), n_gen, job.cached_tokens, n_reasoning)
            return status, build.response(status, usage, why)

        def remember(final: dict) -> None:
            """Keep the response (previous_response_id, GET), the input's items with ids and the output's
            (later item_references)."""
            if body.store is not False:
                self.items.keep(body.input)
                self.items.keep(final["output"])
                self.kept.keep(final, body.resolved_input)

        async def whole(job: Job, client: Request | None) -> tuple[dict, bool]:
            """The job run to its end (client None: a background response's): the final response, kept,
            and whether the output ended (not cut short by a cancel)."""
            out = await self._collect(job, client)
            parsed = parser.feed(out.text)
            parsed.extend(parser.finish(cut=out.reason == "length"))
            build.feed(parsed)
            build.finish("completed" if out.reason not in ("length", None) else "incomplete")  # None: stopped
            final = result(job, out.n_gen, out.reason, parsed.reasoning)[1]
            remember(final)
            return final, out.reason is not None

        if body.background:
            return self._background(build, submit(), whole, body.resolved_input)
        if not body.stream:
            return (await whole(submit(), request))[0]

        jobs: list[Job] = []

        async def events() -> AsyncIterator[str]:
            yield _event(build.event("response.created", response=build.response("in_progress")))
            yield _event(build.event("response.in_progress", response=build.response("in_progress")))
            jobs.append(submit())  # queued once the stream runs: a client gone before leaves nothing
            n_gen, reason, reasoning = 0, None, ""
            async for chunk in jobs[0].events():
                n_gen += len(_chunk_ids(chunk))
                reason = chunk.finish_reason or reason
                d = parser.feed(chunk.text)
                if chunk.finish_reason is not None:
                    d.extend(parser.finish(cut=chunk.finish_reason == "length"))
                reasoning += d.reasoning
                for e in build.feed(d):
                    yield _event(e)
            if reason is None:
                d = parser.finish()
                reasoning += d.reasoning
                for e in build.feed(d):
                    yield _event(e)
            for e in build.finish("incomplete" if reason == "length" else "completed"):
                yield _event(e)
            status, final = result(jobs[0], n_gen, reason, reasoning)
            remember(final)
            yield _event(build.event(f"response.{status}", response=final))

        def failed(err: APIError) -> list[str]:
            """An engine error ends the stream with `error` and `response.failed`."""
            return _response_failed(build, err)

        return self._streaming(_guarded(events(), jobs, failed))

    def _background(
        self,
        build: ResponseBuilder,
        job: Job,
        whole: Callable[[Job, None], Awaitable[tuple[dict, bool]]],
        inputs: list,
    ) -> dict[str, Any]:
        """A background response (`background: true`): answered at once, `queued`, and kept; the job runs
        on without a client and its end (completed / incomplete, failed with the error, or cancelled by
        POST /v1/responses/{id}/cancel) replaces it in the store, where GET reads it."""
        queued = build.response("queued")
        rid = queued["id"]
        self.kept.keep(queued, inputs)

        async def run() -> None:
            ended = False
            try:
                response, ended = await whole(job, None)
            except Exception as e:  # the engine's errors are APIErrors (_collected); others are ours
                err = e if isinstance(e, APIError) else APIError(500, f"internal error: {type(e).__name__}")
                if not isinstance(e, APIError):
                    logging.getLogger("lumo.server").exception("background response %s", rid)
                response = build.response("failed")
                response["error"] = {"code": err.code or "server_error", "message": err.message}
            finally:
                stopped = self._running.pop(rid)[2]
            if stopped == "deleted":
                return
            if stopped == "cancelled" and not ended:  # (a cancel that came as it ended: as it ended)
                response = {**response, "status": "cancelled"}  # its output so far and usage
            self.kept.keep(response, inputs)

        self._running[rid] = (job, asyncio.create_task(run()), None)
        return queued

    async def _stop(self, response_id: str, why: str) -> None:
        """Stop a background response not yet ended (why: cancelled or deleted) and wait for its end."""
        running = self._running.get(response_id)
        if running is not None:
            job, task, _ = running
            self._running[response_id] = (job, task, why)
            job.cancel()  # the engine stops after its current token; a job still waiting leaves now
            self.worker.withdraw()
            await asyncio.shield(task)

    async def cancel_response(self, response_id: str) -> dict[str, Any]:
        """POST /v1/responses/{id}/cancel: a background response still queued or running is stopped and
        kept as `cancelled`; one that already ended is returned as it is (only background responses can be
        cancelled)."""
        response = self.kept.get(response_id)
        if not response.get("background"):
            raise APIError(400, "only a background response can be cancelled", "response_id")
        await self._stop(response_id, "cancelled")
        return self.kept.get(response_id)

    async def count_input_tokens(self, body: InputTokensRequest) -> dict[str, Any]:
        """POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count): the prompt's length in
        tokens as POST /v1/responses would render it (previous_response_id's conversation included)."""
        chat = self._responses_chat(body)
        prompt = await asyncio.to_thread(render_prompt, self.llm.tokenizer, chat)
        ids = await self._encode(prompt, "input", truncating=True)  # counted, however long
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    async def compact_response(self) -> None:
        """POST /v1/responses/compact: not served (a clear 404, not a 405 for an id named "compact")."""
        msg = (
            "POST /v1/responses/compact is not served here: lumo makes no compaction items (a client "
            "compacts its conversation itself on a context_length_exceeded error)"
        )
        raise APIError(404, msg)

    async def stored_response(self, response_id: str, stream: bool = False) -> dict[str, Any]:
        """GET /v1/responses/{id}: a kept response as it was returned; a background one as it stands
        (queued, in_progress once the engine took it, then as it ended)."""
        response = self.kept.get(response_id)
        if stream:
            msg = "stream is not supported here: lumo keeps no events (GET the response until it ends)"
            raise APIError(400, msg, "stream")
        running = self._running.get(response_id)
        if running is not None and running[0].started:
            response["status"] = "in_progress"
        return response

    async def delete_response(self, response_id: str) -> dict[str, Any]:
        """DELETE /v1/responses/{id}: the response is no longer kept (nor continued); a background one not
        yet ended is stopped."""
        self.kept.get(response_id)  # a 404 if not kept
        await self._stop(response_id, "deleted")
        self.kept.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def response_input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        """GET /v1/responses/{id}/input_items: the response's own input items, a page of OpenAI's list
        (newest first unless order=asc; `after` an item id; at most `limit`, 1..100)."""
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be between 1 and 100", "limit")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be asc or desc", "order")
        items = self.kept.input_items(response_id)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in response {response_id!r}", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    # ---- /v1/messages (Anthropic) ----
    async def messages(self, body: MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages API over the chat machinery (lumo/server/anthropic.py); any model name."""
        chat = body.to_chat()
        chat.check_supported()
        by_id = chat.token_settings(self._vocab_size)
        tok = self.llm.tokenizer
        prompt = await asyncio.to_thread(render_prompt, tok, chat)
        prompt_ids = await self._anthropic_prompt(prompt)
        # Clients ask for a fixed max_tokens (Claude Code: 32000) whatever the context: what fits, not a 400
        room = self.llm.max_model_len - len(prompt_ids)
        max_tokens = min(body.max_tokens, room)
        structured = await self._structured(chat)
        tools = chat.template_tools()
        parser = ChatOutputParser(
            in_reasoning=opens_reasoning(prompt, continued_text(chat)),
            parse_tools=chat.parse_tools,
            tools=tools,
        )
        build = MessageBuilder(self.served_name)
        ticket = self.worker.admit()  # a 503 now, or a place held for the job

        def submit() -> Job:
            sampling = {**chat.sampling(0), **by_id, "structured_outputs": structured}
            return self._submit(prompt_ids, max_tokens, sampling, ticket)

        def ending(job: Job, n_gen: int, reason: str | None, why: Any) -> tuple[dict, str, str | None]:
            cut = body.max_tokens > room  # the context, not max_tokens, ended it
            stop, sequence = anthropic_stop_reason(reason, why, parser.n_tool_calls, cut)
            return anthropic_usage(len(prompt_ids), n_gen, job.cached_tokens), stop, sequence

        if not body.stream:
            job = submit()
            out = await self._collect(job, request)
            parsed = parser.feed(out.text)
            parsed.extend(parser.finish(cut=out.reason == "length", close_cut=True))
            build.feed(parsed)
            build.finish()
            return build.message(*ending(job, out.n_gen, out.reason, out.why))

        jobs: list[Job] = []

        async def events() -> AsyncIterator[str]:
            # message_start at once (the cached prompt tokens, known after the prefill, come with
            # message_delta's usage, which clients take over message_start's), then pings while the request
            # waits in the queue or its prefill runs, as the API keeps a stream alive
            yield _event(
                {"type": "message_start", "message": build.message(anthropic_usage(len(prompt_ids), 0, 0))}
            )
            jobs.append(submit())  # queued once the stream runs: a client gone before leaves nothing
            n_gen, reason, why = 0, None, None
            async for chunk in _with_pings(jobs[0].events(), PING_S):
                if chunk is None:
                    yield _event({"type": "ping"})
                    continue
                n_gen += len(_chunk_ids(chunk))
                reason = chunk.finish_reason or reason
                why = getattr(chunk, "stop_reason", None) if chunk.finish_reason else why
                d = parser.feed(chunk.text)
                if chunk.finish_reason is not None:
                    d.extend(parser.finish(cut=chunk.finish_reason == "length", close_cut=True))
                for e in build.feed(d):
                    yield _event(e)
            if reason is None:
                for e in build.feed(parser.finish()):
                    yield _event(e)
            for e in build.finish():
                yield _event(e)
            use, stop, sequence = ending(jobs[0], n_gen, reason, why)
            delta = {"stop_reason": stop, "stop_sequence": sequence}
            yield _event({"type": "message_delta", "delta": delta, "usage": use})
            yield _event({"type": "message_stop"})

        def failed(err: APIError) -> list[str]:  # the API's `error` event
            return [_event(anthropic_error(err.status, err.message)[0])]

        return self._streaming(_guarded(events(), jobs, failed))

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The prompt's length in tokens as /v1/messages would render it."""
        chat = body.to_chat(max_tokens=1)
        chat.check_supported()
        prompt = await asyncio.to_thread(render_prompt, self.llm.tokenizer, chat)
        return {"input_tokens": len(await self._encode(prompt, "messages"))}

    async def _anthropic_prompt(self, prompt: str) -> list[int]:
        """The prompt's ids; one the context cannot hold is the API's "prompt is too long" error, whose
        wording Claude Code looks for (to compact the conversation)."""
        limit = self.llm.max_model_len
        try:
            ids = await self._encode(prompt, "messages")
        except APIError as e:
            if e.code == "context_length_exceeded":
                e.message = f"prompt is too long: {e.message}"
            raise
        if len(ids) >= limit:
            raise APIError(400, f"prompt is too long: {len(ids)} tokens > {limit - 1} maximum", "messages")
        return ids

    async def _stream_chat(
        self,
        start: Callable[[int], tuple[Job, ChatOutputParser]],
        n: int,
        head: dict[str, Any],
        n_prompt: int,
        usage_mode: tuple[bool, bool],
        as_ids: bool = False,
        prompt_ids: list[int] | None = None,
    ) -> AsyncIterator[str]:
        """The n choices' chunks in turn, each under its index (usage_mode: _stream_usage's; as_ids: logprobs
        name tokens by id; prompt_ids: vLLM's return_token_ids, the prompt's ids on each choice's first chunk
        and the tokens' on every chunk; None: not asked)."""
        include_usage, continuous = usage_mode
        fixed = {"usage": None} if include_usage else {}

        def extra(job: Job, tokens: int) -> dict[str, Any]:
            """What a chunk of a choice carries besides it (its job, its tokens so far)."""
            return {"usage": _running_usage(n_prompt, tokens)} if continuous else fixed

        n_gen, jobs = [0], []

        async def choices() -> AsyncIterator[str]:
            for j in range(n):
                job, parser = start(j)
                jobs.append(job)
                async for event in self._chat_choice(j, job, parser, head, extra, n_gen, as_ids, prompt_ids):
                    yield event

        # the prompt's cached tokens: choice 0's
        usage = (lambda: _usage(n_prompt, n_gen[0], jobs[0].cached_tokens)) if include_usage else None
        async for event in _sse_stream(choices(), head, usage, lambda: jobs[-1] if jobs else None):
            yield event

    async def _chat_choice(
        self,
        index: int,
        job: Job,
        parser: ChatOutputParser,
        head: dict[str, Any],
        extra: Callable[[Job, int], dict[str, Any]],
        n_gen: list[int],
        as_ids: bool,
        prompt_ids: list[int] | None,
    ) -> AsyncIterator[str]:
        """One choice's streamed chunks: the role, the parser's deltas, the finish reason (n_gen[0] counts
        its tokens; extra, as_ids and prompt_ids: _stream_chat's)."""
        tok = self.llm.tokenizer
        tokens = 0  # this choice's so far
        held = []  # logprobs of tokens whose text the parser still holds: they go out with the next delta
        held_ids: list[int] = []  # the same tokens' ids (return_token_ids)

        def chunk_of(delta: dict[str, Any], reason: str | None = None, top: dict | None = None) -> str:
            logprobs = None
            if job.wants_logprobs:
                logprobs = {"content": chat_entries(tok, held, as_ids), "refusal": None}
                held.clear()
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["stop_reason"] = why  # vLLM's, on the chunk that finishes the choice
            if prompt_ids is not None:
                choice["token_ids"] = held_ids[:]
                held_ids.clear()
            return _sse({**head, **(top or {}), "choices": [choice], **extra(job, tokens)})

        reason = why = None
        first = None if prompt_ids is None else {"prompt_token_ids": prompt_ids}
        yield chunk_of({"role": "assistant", "content": ""}, top=first)
        async for chunk in job.events():
            ids = _chunk_ids(chunk)
            tokens += len(ids)
            n_gen[0] += len(ids)
            reason = chunk.finish_reason or reason
            why = getattr(chunk, "stop_reason", None) if chunk.finish_reason else why
            held_ids += ids
            if job.wants_logprobs:
                held.extend(chunk_logprobs(chunk))
            d = parser.feed(chunk.text)
            if chunk.finish_reason is not None:
                d.extend(parser.finish(cut=chunk.finish_reason == "length"))
            if d:
                yield chunk_of(delta_json(d))
        if reason is None:  # the engine stopped without saying why: flush what the parser holds
            d = parser.finish()
            if d:
                yield chunk_of(delta_json(d))
        yield chunk_of({}, finish_reason(reason, parser.n_tool_calls))

    @staticmethod
    def _streaming(events: AsyncIterator[str]) -> StreamingResponse:
        """A stream of an admitted request (its ticket holds its place: a full queue was a 503 before the
        stream, never an error event inside it that clients retrying on 503 would not see)."""
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _served_names(model_name: str | Sequence[str] | None, llm: Any) -> list[str]:
    """The names the API serves the model under (create_app's model_name), the first reported."""
    names = [n for n in ([model_name] if isinstance(model_name, str) else model_name or ()) if n]
    return names or [llm.model_name]


def create_app(
    llm: Any,
    model_name: str | Sequence[str] | None = None,
    max_queue: int = 64,
    api_key: str | None = None,
    allowed_origins: Sequence[str] = (),
    return_tokens_as_token_ids: bool = False,
) -> FastAPI:
    """The FastAPI app serving `llm`; its engine worker thread starts and stops with the app's lifespan.
    api_key: required of every request but /health, /ping, /version and /metrics. allowed_origins: web
    origins whose pages may call the API from a browser (CORS; "*" any); none by default.
    return_tokens_as_token_ids: the default of the requests' field (vLLM's server flag). model_name: the
    name served (several: the first, the others accepted too, as vLLM's --served-model-name takes them);
    None: the model's own."""
    names = _served_names(model_name, llm)
    served = names[0]
    metrics = ServerMetrics()
    worker = EngineWorker(llm, metrics, max_queue)
    metrics.registry.gauge("lumo_num_requests_waiting", "requests queued for the engine", worker.queue_length)
    metrics.registry.gauge("lumo_num_requests_running", "requests the engine is generating", worker.running)
    add_vllm_names(metrics.registry, served)
    server = _Server(llm, served, worker, metrics, return_tokens_as_token_ids, aliases=names)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="lumo", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    if api_key is not None:
        if not api_key.strip():  # (the middleware is built lazily, at the first request)
            raise ValueError("the API key is empty")
        app.add_middleware(_RequireKey, key=api_key)
    app.add_middleware(_CountRequests, metrics=metrics)  # counts the 401s too
    if allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    app.add_api_route("/health", server.health, methods=["GET", "HEAD"])  # load balancers probe with HEAD
    app.add_api_route("/ping", server.health, methods=["GET", "POST"])  # vLLM's (SageMaker's probe)
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/responses", server.responses, methods=["POST"])
    app.add_api_route("/v1/responses/input_tokens", server.count_input_tokens, methods=["POST"])
    app.add_api_route("/v1/responses/compact", server.compact_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", server.stored_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", server.delete_response, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", server.cancel_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}/input_items", server.response_input_items, methods=["GET"])
    app.add_api_route("/v1/messages", server.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    return app


def run_server(
    llm: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | Sequence[str] | None = None,
    max_queue: int = 64,
    api_key: str | None = None,
    allowed_origins: Sequence[str] = (),
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    return_tokens_as_token_ids: bool = False,
) -> None:
    """Serve `llm` until interrupted; prints one startup line with the URL and the model. ssl_certfile /
    ssl_keyfile: serve HTTPS (checked here: a bad pair is a one-line ValueError, not uvicorn's traceback).
    The other arguments are create_app's."""
    if ssl_certfile is not None or ssl_keyfile is not None:
        check_tls(ssl_certfile, ssl_keyfile)
    sock = _listen(host, port)
    app = create_app(llm, model_name, max_queue, api_key, allowed_origins, return_tokens_as_token_ids)
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if ssl_certfile else "http"
    print(
        f"lumo: serving {', '.join(_served_names(model_name, llm))} (context {llm.max_model_len} tokens) "
        f"at {scheme}://{shown}:{port}/v1" + (" (API key required)" if api_key is not None else ""),
        flush=True,
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=5,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    _Uvicorn(config, app.state.server.worker).run(sockets=[sock])


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    """A certificate and its key that TLS can serve with (both given, readable, matching), or a ValueError
    saying which is wrong."""
    import ssl

    if not certfile or not keyfile:
        raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except FileNotFoundError as e:
        raise ValueError(f"no such TLS file: {e.filename}") from None
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"cannot use {certfile} / {keyfile} for TLS: {e.strerror or e}") from None


class _Uvicorn(uvicorn.Server):
    """uvicorn's server that ends the engine's jobs (a 503 each) as soon as shutdown begins: their requests
    answer (a JSON error, or an error event and [DONE]) before uvicorn waits for the connections to close,
    instead of being cut off when its wait runs out."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker) -> None:
        super().__init__(config)
        self._worker = worker

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._worker.stop(wait=False)
        await super().shutdown(sockets)


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the startup line: a busy port or an unknown host is a one-line
    user error (ValueError), not uvicorn's log line after "serving"."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # one address; IPv4 first where a name has both (e.g. localhost), as clients mostly dial 127.0.0.1
        family, kind, proto, _, addr = min(infos, key=lambda i: i[0] != socket.AF_INET)
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:  # socket.gaierror included
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
