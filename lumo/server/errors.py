"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure, including
FastAPI's request validation (kept at 422) and malformed JSON (400); under /v1/messages Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}` (error_response chooses by path)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("lumo.server")

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    """A request the server refuses; becomes an OpenAI-style JSON error with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.details = details  # Anthropic's error.details (an error code its SDKs act on)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# what a 404 for a path lumo does not route names instead (embeddings, moderations, stored responses...)
SERVED = (
    "POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens, "
    "/v1/responses/{id}/cancel, /v1/responses/input_tokens, /tokenize, /detokenize; GET /v1/models, "
    "/v1/models/{id}, /v1/responses/{id}, /v1/responses/{id}/input_items, /health, /ping, /version, "
    "/metrics; DELETE /v1/responses/{id}"
)

# Anthropic's Messages API (lumo/server/anthropic.py) has its own error shape and types
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(
    status: int, message: str, details: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int]:
    """Anthropic's error body `{"type": "error", "error": {"type", "message"[, "details"]}}` and the status:
    its validation errors are 400s, not 422s, and "overloaded" is its own 529."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    status = {422: 400, 503: 529}.get(status, status)
    error = {"type": kind, "message": message} | ({"details": details} if details else {})
    return {"type": "error", "error": error}, status


def error_response(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    details: dict[str, Any] | None = None,
    **kw: Any,
) -> JSONResponse:
    """An error in the shape of the API `path` belongs to (OpenAI's, or Anthropic's under /v1/messages)."""
    if is_messages_path(path):
        body, status = anthropic_error(status, message, details)
        return JSONResponse(body, status_code=status, **kw)
    return JSONResponse(error_body(status, message, param, code), status_code=status, **kw)


# pydantic's names of a union's members in an error's location (`stop.str`, `tool_choice.literal[...]`,
# `content.list[...]`, a model's class name): not the request's fields
_TYPE_NAMES = {"str", "int", "float", "bool", "none", "bytes", "list", "dict", "any"}


def _is_field(p: Any) -> bool:
    """A field name, list index or dict key, not a union member's type or model name."""
    if not isinstance(p, str):
        return True
    return p not in _TYPE_NAMES and "[" not in p and not (p.isidentifier() and p[:1].isupper())


def loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body" and _is_field(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _validation_error(
    exc: RequestValidationError, content_type: str = "application/json", path: str = ""
) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(path, 400, f"malformed JSON body: {detail}".rstrip(": "))
    param = loc_to_param(tuple(first.get("loc", ())))
    if param is None:
        msg = "the request body must be a JSON object"
        if "json" not in content_type.lower():  # FastAPI reads a JSON body only under a JSON content type
            msg += f" sent as Content-Type: application/json (got {content_type or 'none'!r})"
    else:
        msg = f"{param}: {first.get('msg', 'invalid value')}"
        bad = first.get("input")
        if isinstance(bad, str | int | float | bool) and len(repr(bad)) <= 60:
            msg += f" (got {bad!r})"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(path, 422, msg, param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code, exc.details)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.headers.get("content-type", ""), request.url.path)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no route: say what is served instead
            message = f"{request.method} {request.url.path} is not served here; lumo serves {SERVED}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(request.url.path, exc.status_code, message)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
