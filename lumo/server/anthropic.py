"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat machinery, for
clients built on it: Claude Code with ANTHROPIC_BASE_URL, the anthropic SDK.

The request's `system` and `messages` become chat messages that the model's own template renders: a
message's text blocks joined by newlines, an assistant's `tool_use` blocks its tool calls and its `thinking`
block its reasoning, a user's `tool_result` blocks tool messages (before the user's text, as the API orders
them); the model thinks only when `thinking` asks for it, as in the API.
`tools` (name, description, input_schema) are the chat's function tools, `tool_choice` auto / any / tool /
none the chat's auto / required / a named function / none. The output parser's reasoning, text and tool
calls become `thinking`, `text` and `tool_use` content blocks; streamed, each block is opened
(content_block_start), filled (content_block_delta: text_delta, thinking_delta, input_json_delta) and
closed (content_block_stop) in turn between message_start and message_stop, and stop_reason tells why the
message ended: max_tokens, model_context_window_exceeded, tool_use, stop_sequence (with the string) or
end_turn.

An image or a document (a user's, or a tool result's: Claude Code's Read tool returns images) is a short
note saying it was left out, not a 400: it stays in the conversation's history, and a refused block would
fail every later turn.

lumo serves one model: any `model` name is answered by it (Claude Code asks for its own model names).
Errors have the API's shape, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from .chat import fold_system_messages, left_out
from .errors import APIError, loc_to_param
from .protocol import ChatCompletionRequest
from .toolparse import ParsedDelta


class MessagesRequest(BaseModel):
    """The fields lumo honours; the API's others (metadata, service_tier, container, mcp_servers, ...) are
    accepted and ignored. `cache_control` marks are ignored too: lumo's prefix cache needs none."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict[str, Any]]
    max_tokens: StrictInt = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool | None = False
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # structured output: output_config.format, or the beta's top-level output_format (LiteLLM sends it)
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    # message threads (a beta: the server keeps the conversation): lumo keeps none, so a request that
    # names a thread is refused with the code the SDK's tool runner recovers from (it resends the history)
    thread: Any = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """`system` and `messages` as chat messages (a 400 naming the block for what lumo cannot take)."""
        out = [] if self.system is None else [{"role": "system", "content": _text(self.system, "system")}]
        for i, m in enumerate(self.messages):
            out += _chat_message(m, f"messages[{i}]")
        if all(m["role"] == "system" for m in out):
            what = "must not be empty" if not self.messages else "need a user or assistant message"
            raise APIError(400, f"messages {what}", "messages")
        fold_system_messages(out)  # Claude Code puts system messages among the messages too
        return out

    def to_chat(self, max_tokens: int | None = None) -> ChatCompletionRequest:
        """The equivalent chat request; max_tokens: a value to use instead of the request's (count_tokens
        sends none)."""
        tools = [_chat_tool(i, t) for i, t in enumerate(self.tools or [])]
        choice, parallel = _chat_tool_choice(self.tool_choice)
        if choice not in (None, "auto", "none") and not tools:
            raise APIError(400, "tool_choice any / tool needs a non-empty tools list", "tool_choice")
        thinking = (self.thinking or {}).get("type")
        if thinking not in (None, "enabled", "disabled", "adaptive"):
            raise APIError(
                400, f"thinking.type {thinking!r} is not enabled, disabled or adaptive", "thinking"
            )
        if self.thread not in (None, False):
            raise APIError(
                400,
                "thread is not supported: lumo keeps no conversations; send the whole history",
                "thread",
                details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]},
            )
        messages = self.chat_messages()
        prefilled = messages[-1]["role"] == "assistant"  # the API's prefill: the reply continues it
        body = {
            "messages": messages,
            "continue_final_message": prefilled or None,
            "add_generation_prompt": False if prefilled else None,
            "tools": tools or None,
            "tool_choice": choice if tools else None,
            "parallel_tool_calls": parallel,
            "max_tokens": max_tokens if max_tokens is not None else self.max_tokens,
            "stop": self.stop_sequences or None,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or None,  # 0: the API's "off"
            # no `thinking` is no extended thinking, as in the API (Claude Code's short background calls);
            # Qwen's templates switch it with this, others ignore it
            "chat_template_kwargs": None
            if thinking in ("enabled", "adaptive")
            else {"enable_thinking": False},
            "response_format": self._response_format(),
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            param = loc_to_param(tuple(err["loc"])) or "messages"
            raise APIError(400, f"{param}: {err['msg']}", param) from None

    def _response_format(self) -> dict[str, Any] | None:
        """output_config.format (or the beta's output_format) as the chat's response_format: a JSON schema
        the reply's text follows (the grammar of chat's json_schema)."""
        config = self.output_config or {}
        if not isinstance(config, dict):
            raise APIError(400, "output_config must be an object", "output_config")
        fmt, where = config.get("format"), "output_config.format"
        if fmt is None:
            fmt, where = self.output_format, "output_format"
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            raise APIError(400, f"{where}.type {kind!r} is not supported (json_schema)", where)
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, f"{where}.schema must be a JSON schema object", where)
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: StrictInt | None = Field(default=None, ge=1)


# a block lumo's models cannot read -> the note that stands in for it
_LEFT_OUT = {"image": left_out("an image"), "document": left_out("a document")}


def _text(content: Any, where: str, notes: bool = False) -> str:
    """A string, or text blocks joined (notes: images and documents as _LEFT_OUT's notes; any other block:
    a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", where)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if notes and isinstance(kind, str) and kind in _LEFT_OUT:
            parts.append(_LEFT_OUT[kind])
            continue
        if kind != "text":
            raise APIError(
                400, f"{where}[{j}]: content block type {kind!r} is not supported here (text)", where
            )
        if not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{j}]: a text block needs `text`, a string", where)
        parts.append(block["text"])
    return "\n".join(parts)  # blocks stay apart (Claude Code's reminders, then the prompt)


def _chat_message(m: Any, where: str) -> list[dict[str, Any]]:
    """One message as chat messages: an assistant's text, reasoning and tool calls in one; a user's tool
    results as tool messages, then its text (if any) as a user message."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        role = m.get("role") if isinstance(m, dict) else None
        raise APIError(400, f"{where}.role {role!r} is not user, assistant or system", where)
    if m["role"] == "system":  # chat_messages folds it (text blocks only, as `system`'s)
        return [{"role": "system", "content": _text(m.get("content"), f"{where}.content")}]
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks", where)
    text, reasoning, calls, results = [], [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise APIError(400, f"{at}: a text block needs `text`, a string", at)
            text.append(b["text"])
        elif isinstance(kind, str) and kind in _LEFT_OUT and m["role"] == "user":
            text.append(_LEFT_OUT[kind])
        elif kind == "thinking" and m["role"] == "assistant" and isinstance(b.get("thinking"), str):
            reasoning.append(b["thinking"])
        elif kind == "redacted_thinking" and m["role"] == "assistant":
            pass  # encrypted: nothing lumo can show the model
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise APIError(400, f"{at}: a tool_use block needs a name and an input object", at)
            args = json.dumps(b.get("input", {}), ensure_ascii=False)
            calls.append(
                {"id": b.get("id"), "type": "function", "function": {"name": b["name"], "arguments": args}}
            )
        elif kind == "tool_result" and m["role"] == "user":
            out = b.get("content", "")
            result = _text(out, f"{at}.content", notes=True)
            if b.get("is_error") is True:
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result})
        else:
            raise APIError(
                400, f"{at}: content block type {kind!r} is not supported in a {m['role']} message", at
            )
    if m["role"] == "user":
        return results + ([{"role": "user", "content": "\n".join(text)}] if text or not results else [])
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(text) if text or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return [msg]


# Anthropic-defined client tools (the client runs them; the API defines their input): the bash tool and
# the text editor, as function tools with that input. Versions before 2025-04-29 have undo_edit.
_BASH = {
    "description": "Run a command in a persistent bash shell; restart: true starts a fresh shell.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "restart": {"type": "boolean"}},
    },
}


def _text_editor(undo: bool) -> dict[str, Any]:
    commands = ["view", "create", "str_replace", "insert"] + (["undo_edit"] if undo else [])
    return {
        "description": (
            "View and edit text files. view: a file's lines (view_range [first, last], -1 for the end) or "
            "a directory's entries; create: a new file with file_text; str_replace: replace old_str, which "
            "must occur exactly once, by new_str; insert: new_str after line insert_line (0: at the top)"
            + ("; undo_edit: revert the last edit of path." if undo else ".")
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": commands},
                "path": {"type": "string"},
                "file_text": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
                "insert_line": {"type": "integer"},
                "view_range": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["command", "path"],
        },
    }


def _defined_tool(kind: str) -> dict[str, Any] | None:
    """The function form of an Anthropic-defined client tool type (bash_YYYYMMDD, text_editor_YYYYMMDD)."""
    version = kind.rpartition("_")[2]
    if not (version.isdigit() and len(version) == 8):
        return None
    if kind.startswith("bash_"):
        return _BASH
    if kind.startswith("text_editor_"):
        return _text_editor(undo=version < "20250429")
    return None


def _chat_tool(i: int, tool: Any) -> dict[str, Any]:
    """A client tool (name, description, input_schema) as a chat function tool, and the bash and text editor
    tools the API defines (their input as the API defines it); server tools (web search, code execution,
    ...) run on Anthropic's side, and the computer tool needs screenshots: a 400."""
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    defined = _defined_tool(kind) if isinstance(kind, str) else None
    if defined is not None and isinstance(tool.get("name"), str):
        return {"type": "function", "function": {"name": tool["name"], **defined}}
    if (
        not isinstance(tool, dict)
        or tool.get("type", "custom") != "custom"
        or not isinstance(tool.get("name"), str)
    ):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(
            400, f"{where}: tool type {kind!r} is not supported (client tools with a name only)", where
        )
    schema = tool.get("input_schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise APIError(400, f"{where}.input_schema must be a JSON schema object", where)
    fn = {"name": tool["name"], "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(the chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, f"tool_choice {choice!r} is not auto, any, tool (with a name) or none", "tool_choice")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(
    engine_reason: str | None, stop: str | int | None, n_tool_calls: int, context_cut: bool = False
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish and stop reasons. A length cut comes first: a
    tool call it cut short is no call to run (the API says max_tokens then, and clients retry);
    context_cut: the context's end, not the request's max_tokens, was the limit."""
    if engine_reason in (None, "length"):
        return ("model_context_window_exceeded" if context_cut else "max_tokens"), None
    if n_tool_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(n_prompt: int, n_gen: int, cached: int) -> dict[str, int]:
    """The API's usage: input_tokens are the prompt tokens not read from the (prefix) cache."""
    return {
        "input_tokens": n_prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": n_gen,
    }


class MessageBuilder:
    """A message's content blocks from the chat parser's deltas, in order, and the streamed events that
    open, fill and close them: `feed(delta)` and `finish()` (closes the last block) return the events."""

    def __init__(self, model: str) -> None:
        self.id, self.model = new_id("msg"), model
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the block being filled: always the last one
        self._args = ""  # the open tool_use block's arguments (JSON text) so far

    def message(self, usage: dict[str, int], reason: str | None = None, stop: str | None = None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": json.loads(json.dumps(self.blocks)),
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": usage,
        }

    def feed(self, d: ParsedDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, value in d.parts:
            if kind != "tool":
                events += self._text("thinking" if kind == "reasoning" else "text", value)
                continue
            if value.id is not None:  # a new call: its own block
                events += self._close()
                events += self._add({"type": "tool_use", "id": value.id, "name": value.name, "input": {}})
            if value.arguments:
                self._args += value.arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": value.arguments}))
        return events

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    def _add(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        self.open = block
        start = json.loads(json.dumps(block))
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._add({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
        self.open[kind] += text
        events.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = []
        if self.open["type"] == "tool_use":
            args = json.loads(self._args) if self._args.strip() else {}
            self.open["input"] = args if isinstance(args, dict) else {}  # the parser passes objects only
            self._args = ""
        elif self.open["type"] == "thinking":  # the API signs a thinking block just before it closes
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*events, {"type": "content_block_stop", "index": len(self.blocks) - 1}]
