"""Split chat output into content, reasoning (`<think>`) and tool calls (`<tool_call>`), incrementally.

`ChatOutputParser.feed(delta)` takes text deltas as they stream out of the engine and returns what can be
sent now; text that might be the start of a tag (`<tool` ...) is held back until the next delta decides it.
Feeding the whole text at once and feeding it in any split gives the same concatenated result, so the
non-streaming response is the streamed one, assembled.

Tool calls come in two shapes, both parsed when the closing tag arrives:
    <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>                        (JSON, Qwen3)
    <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>  (XML, Qwen3-coder)
A tool call that does not parse is returned as plain content, tags included, so nothing is lost.

A complete tool call inside the reasoning (Qwen3 models sometimes call a tool before `</think>`, or never
close it) is a tool call too, taken out of the reasoning text; one that is not closed before `</think>` or
the end, or does not parse, stays reasoning text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

_CONTENT, _REASONING, _TOOL = "content", "reasoning", "tool"
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.S)
# a parameter ends at its closing tag, or (tolerating a sloppy model) at the next parameter / the end
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class ChatOutputParser:
    """A small state machine over text deltas: content <-> reasoning, content -> tool call -> content.

    in_reasoning: the prompt already opened `<think>` (the template did), so the output starts inside the
    reasoning and only `</think>` will appear. tools: the request's OpenAI tool list, whose JSON schemas type
    the XML form's parameter values. parse_tools=False leaves `<tool_call>` text in the content.
    Whitespace that only separates parts (after `</think>`, around tool calls, at the end) is dropped.
    """

    def __init__(
        self, in_reasoning: bool = False, parse_tools: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> None:
        self._mode = _REASONING if in_reasoning else _CONTENT
        self._tags = (THINK_OPEN, TOOL_OPEN) if parse_tools else (THINK_OPEN,)
        self._reasoning_tags = (THINK_CLOSE, TOOL_OPEN) if parse_tools else (THINK_CLOSE,)
        self._schemas = _parameter_schemas(tools or [])
        self._buf = ""  # text not yet classified
        self._held_ws = ""  # trailing content whitespace, sent only if more content follows
        self._at_start = True  # no content since the start or the last tag: leading whitespace is dropped
        self.n_tool_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """End of output: flush what was held back; an unclosed tool call is parsed as it stands."""
        out = ParsedDelta()
        buf, self._buf = self._buf, ""
        if self._mode == _REASONING:
            out.reasoning += buf
        elif self._mode == _TOOL:
            self._close_tool_call(buf, out, closed=False)
        else:
            self._content(buf, out, boundary=True)
        self._held_ws = ""
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consume as much of the buffer as the current mode allows; True if the mode changed."""
        buf = self._buf
        if self._mode == _REASONING:
            i = buf.find(THINK_CLOSE)
            j = buf.find(TOOL_OPEN) if TOOL_OPEN in self._reasoning_tags else -1
            if j >= 0 and (i < 0 or j < i):
                return self._tool_call_in_reasoning(buf, j, i, out)
            if i < 0:
                keep = _partial_tag_len(buf, self._reasoning_tags)
                out.reasoning += buf[: len(buf) - keep]
                self._buf = buf[len(buf) - keep :]
                return False
            out.reasoning += buf[:i]
            self._buf = buf[i + len(THINK_CLOSE) :]
            self._mode, self._at_start = _CONTENT, True
            return True
        if self._mode == _TOOL:
            i = buf.find(TOOL_CLOSE)
            if i < 0:
                return False  # the whole call is needed before it can be parsed
            self._buf = buf[i + len(TOOL_CLOSE) :]
            self._close_tool_call(buf[:i], out, closed=True)
            return True
        hits = [(i, t) for t in self._tags if (i := buf.find(t)) >= 0]
        if not hits:
            keep = _partial_tag_len(buf, self._tags)
            self._content(buf[: len(buf) - keep], out, boundary=False)
            self._buf = buf[len(buf) - keep :]
            return False
        i, tag = min(hits)
        self._content(buf[:i], out, boundary=True)
        self._buf = buf[i + len(tag) :]
        self._mode = _REASONING if tag == THINK_OPEN else _TOOL
        return True

    def _tool_call_in_reasoning(self, buf: str, j: int, i: int, out: ParsedDelta) -> bool:
        """`<tool_call>` at j inside the reasoning (`</think>` at i, or -1): a call if it closes before
        `</think>` and parses; held back while neither has come. True if the buffer was consumed."""
        k = buf.find(TOOL_CLOSE, j)
        if k < 0 or (0 <= i < k):
            if i >= 0:  # </think> came first: reasoning text, up to and with the </think> handled next
                out.reasoning += buf[:i]
                self._buf = buf[i:]
                return True
            out.reasoning += buf[:j]
            self._buf = buf[j:]
            return False
        end = k + len(TOOL_CLOSE)
        call = parse_tool_call(buf[j + len(TOOL_OPEN) : k], self._schemas)
        if call is None:
            out.reasoning += buf[:end]
        else:
            out.reasoning += buf[:j]
            self.n_tool_calls += 1
            out.tool_calls.append(call)
        self._buf = buf[end:]
        return True

    def _content(self, text: str, out: ParsedDelta, boundary: bool) -> None:
        # boundary: a tag or the end follows `text`, so its trailing whitespace is only separation
        if self._at_start:
            text = text.lstrip()
            if not text:
                return
            self._at_start = False
        text = self._held_ws + text
        stripped = text.rstrip()
        self._held_ws = "" if boundary else text[len(stripped) :]
        out.content += stripped

    def _close_tool_call(self, body: str, out: ParsedDelta, closed: bool) -> None:
        call = parse_tool_call(body, self._schemas)
        self._mode, self._at_start = _CONTENT, True
        if call is None:
            raw = TOOL_OPEN + body + (TOOL_CLOSE if closed else "")
            self._at_start = False
            out.content += self._held_ws + raw
            self._held_ws = ""
            return
        self._held_ws = ""
        self.n_tool_calls += 1
        out.tool_calls.append(call)


def _parameter_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name: JSON schema}."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = props
    return out


def parse_tool_call(body: str, schemas: dict[str, dict[str, Any]] | None = None) -> ToolCall | None:
    """The text between `<tool_call>` and `</tool_call>` as a ToolCall, or None if it is neither form."""
    s = body.strip()
    if s.startswith("<function="):
        return _parse_xml(s, (schemas or {}))
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:  # a model that double-encodes its arguments: keep the string if it is JSON already
            json.loads(args)
            return ToolCall(obj["name"], args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_xml(s: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    m = _FUNCTION_RE.match(s)
    if m is None:
        return None
    name = m.group(1).strip()
    props = schemas.get(name, {})
    args: dict[str, Any] = {}
    for p in _PARAM_RE.finditer(m.group(2)):
        key = p.group(1).strip()
        value = p.group(2)
        # the template puts the value on its own lines: drop exactly that one newline on each side
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = _typed_value(value, props.get(key))
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _typed_value(value: str, schema: Any) -> Any:
    """The XML form carries every value as text; the tool's JSON schema says what it really is.
    Parameters without a schema, or typed as strings, stay strings (as in vLLM's qwen3_coder parser)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = set(types) if isinstance(types, list) else {types}
    if types & {None, "string"}:
        return value
    if "boolean" in types and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value
