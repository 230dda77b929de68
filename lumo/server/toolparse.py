"""Split chat output into content, reasoning (`<think>`) and tool calls (`<tool_call>`), incrementally.

`ChatOutputParser.feed(delta)` takes text deltas as they stream out of the engine and returns what can be
sent now; text that might be the start of a tag (`<tool` ...) is held back until the next delta decides it.
Feeding the whole text at once and feeding it in any split gives the same concatenated result, so the
non-streaming response is the streamed one, assembled.

Tool calls come in two shapes:
    <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>                        (JSON, Qwen3)
    <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>  (XML, Qwen3-coder)
A JSON call is parsed when its closing tag arrives; one that does not parse is returned as plain content,
tags included, so nothing is lost. An XML call streams (`ToolCallPiece`s, OpenAI's streamed tool calls):
its id and name once `<function=NAME>` is whole, then its JSON arguments as they come: a string value
as its text arrives (a long file an agent writes shows up while it is generated), a typed value (the
tool's schema says number, boolean, object...) when its parameter ends. A call's pieces concatenated are
its arguments, whatever the split.

A complete tool call inside the reasoning (Qwen3 models sometimes call a tool before `</think>`, or never
close it) is a tool call too, taken out of the reasoning text; one that is not closed before `</think>` or
the end, or does not parse, stays reasoning text.

A call of a custom tool (OpenAI's free-form tools: the model sees a function with one string parameter,
`input`) carries that parameter's text instead of JSON arguments (`custom` set; _CustomInput): streamed as
it is generated too, and the same whatever the split.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

_CONTENT, _REASONING, _TOOL = "content", "reasoning", "tool"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it; a custom tool's input text (custom)
    id: str = field(default_factory=new_tool_call_id)
    custom: bool = False


@dataclass
class ToolCallPiece:
    """Part of tool call `index` (numbered over the whole output): its first piece carries the id and the
    name, every piece a fragment of the JSON arguments (of a custom tool's input text: custom)."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None
    custom: bool = False

    @classmethod
    def whole(cls, index: int, call: ToolCall) -> ToolCallPiece:
        return cls(index, call.arguments, call.name, call.id, call.custom)


@dataclass
class ParsedDelta:
    """What became certain with some output text: `parts` in the order they came in the text,
    ("content" | "reasoning", text) or ("tool", piece) (the Responses API's items follow it); `content`,
    `reasoning` and `tool_calls` are its parts of each kind."""

    parts: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(v for k, v in self.parts if k == "content")

    @property
    def reasoning(self) -> str:
        return "".join(v for k, v in self.parts if k == "reasoning")

    @property
    def tool_calls(self) -> list[ToolCallPiece]:
        return [v for k, v in self.parts if k == "tool"]

    def __bool__(self) -> bool:
        return bool(self.parts)

    def extend(self, other: ParsedDelta) -> None:
        add = {"content": self.add_content, "reasoning": self.add_reasoning, "tool": self.add_piece}
        for kind, value in other.parts:
            add[kind](value)

    def add_content(self, text: str) -> None:
        self._add_text("content", text)

    def add_reasoning(self, text: str) -> None:
        self._add_text("reasoning", text)

    def _add_text(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.parts and self.parts[-1][0] == kind:
            self.parts[-1] = (kind, self.parts[-1][1] + text)
        else:
            self.parts.append((kind, text))

    def add_piece(self, piece: ToolCallPiece) -> None:
        """Append a piece; one that continues the last part's call joins it."""
        kind, last = self.parts[-1] if self.parts else (None, None)
        if kind == "tool" and last.index == piece.index and piece.id is None:
            last.arguments += piece.arguments
        else:
            self.parts.append(("tool", replace(piece)))

    def calls(self) -> list[ToolCall]:
        """The whole tool calls these pieces make (every call's first piece among them)."""
        out: dict[int, ToolCall] = {}
        for p in self.tool_calls:
            if p.id is not None:
                out[p.index] = ToolCall(p.name or "", p.arguments, p.id, p.custom)
            else:
                out[p.index].arguments += p.arguments
        return [out[i] for i in sorted(out)]


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
    reasoning=False: the reasoning is recognised but left out of the output (vLLM's include_reasoning).
    custom: the names of the request's custom tools, whose calls carry their input text (_CustomInput).
    Whitespace that only separates parts (after `</think>`, around tool calls) is dropped; the output's own
    leading and trailing whitespace (a continued line's indentation, the text before a stop string) is kept.
    """

    def __init__(
        self,
        in_reasoning: bool = False,
        parse_tools: bool = True,
        tools: list[dict[str, Any]] | None = None,
        reasoning: bool = True,
        custom: Collection[str] = (),
    ) -> None:
        self._shows_reasoning = reasoning
        self._custom = frozenset(custom)
        self._mode = _REASONING if in_reasoning else _CONTENT
        self._tags = (THINK_OPEN, TOOL_OPEN) if parse_tools else (THINK_OPEN,)
        self._reasoning_tags = (THINK_CLOSE, TOOL_OPEN) if parse_tools else (THINK_CLOSE,)
        self._schemas = _parameter_schemas(tools or [])
        self._buf = ""  # text not yet classified
        self._held_ws = ""  # trailing content whitespace, sent only if more content follows
        self._at_start = False  # no content since the last tag: leading whitespace is dropped
        self._xml: _XmlArguments | None = None  # the XML call streaming now
        self._input: _CustomInput | None = None  # its input text, if it calls a custom tool
        self.n_tool_calls = 0
        self.reasoned = False  # reasoning was parsed (shown or not: vLLM's include_reasoning false)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._step(out):
            pass
        return self._shown(out)

    def finish(self, cut: bool = False, close_cut: bool = False) -> ParsedDelta:
        """End of output: flush what was held back; an unclosed tool call is parsed as it stands.
        cut: the token limit ended the output (finish_reason length). A call it cut short after its name is
        a call, in either form, whose arguments stay cut where the output stopped, as OpenAI's API sends
        them: not JSON, so that a client (LangChain's invalid_tool_calls) does not run a call whose values
        were cut (a truncated file). close_cut: its arguments closed into a JSON object (Anthropic's API,
        whose tool_use input is an object): a JSON-form call's members that were whole, or cut inside a
        string; an XML call's parameters as they stand. A call cut before its name was whole is left out:
        markup, not text."""
        out = ParsedDelta()
        buf, self._buf = self._buf, ""
        if self._mode == _REASONING:
            out.add_reasoning(buf)
        elif self._mode == _TOOL and self._xml is not None:
            keep_cut = cut and not close_cut
            text = self._xml.feed(buf, final=not keep_cut, cut=cut)
            self._end_xml_call(text, out, closed=not keep_cut)
        elif self._mode == _TOOL:
            self._close_tool_call(buf, out, closed=False, cut=cut, close_cut=close_cut)
        else:  # the end: trailing whitespace is the output's own, unless a tag came just before it
            self._content(buf, out, boundary=False)
            out.add_content(self._held_ws)
        self._held_ws = ""
        return self._shown(out)

    def _shown(self, d: ParsedDelta) -> ParsedDelta:
        self.reasoned = self.reasoned or any(k == "reasoning" and v for k, v in d.parts)
        return d if self._shows_reasoning else ParsedDelta([p for p in d.parts if p[0] != "reasoning"])

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
                out.add_reasoning(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            out.add_reasoning(buf[:i])
            self._buf = buf[i + len(THINK_CLOSE) :]
            self._mode, self._at_start = _CONTENT, True
            return True
        if self._mode == _TOOL:
            return self._tool_step(buf, out)
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

    def _tool_step(self, buf: str, out: ParsedDelta) -> bool:
        """Inside `<tool_call>`: an XML call streams from its `<function=NAME>` on; any other waits for
        `</tool_call>` (or the end) and is parsed whole. True if the call ended."""
        i = buf.find(TOOL_CLOSE)
        if self._xml is None:
            head = _xml_head(buf if i < 0 else buf[:i])
            if head is None or (head is _UNDECIDED and i >= 0):  # not XML: the whole call is needed
                if i < 0:
                    return False
                self._buf = buf[i + len(TOOL_CLOSE) :]
                self._close_tool_call(buf[:i], out, closed=True)
                return True
            if head is _UNDECIDED:
                return False
            name, at = head
            call = ToolCall(name, "", custom=name in self._custom)
            out.add_piece(ToolCallPiece.whole(self.n_tool_calls, call))
            self.n_tool_calls += 1
            self._xml = _XmlArguments(self._schemas.get(name, {}))
            self._input = _CustomInput() if call.custom else None
            buf, i = buf[at:], (i - at if i >= 0 else -1)
        if i < 0:
            keep = _partial_tag_len(buf, (TOOL_CLOSE,))
            self._add_arguments(self._xml.feed(buf[: len(buf) - keep]), out)
            self._buf = buf[len(buf) - keep :]
            return False
        self._buf = buf[i + len(TOOL_CLOSE) :]
        self._end_xml_call(self._xml.feed(buf[:i], final=True), out)
        return True

    def _add_arguments(self, text: str, out: ParsedDelta, final: bool = False) -> None:
        if self._input is not None:
            text = self._input.feed(text, final)
        if text:
            out.add_piece(ToolCallPiece(self.n_tool_calls - 1, text, custom=self._input is not None))

    def _end_xml_call(self, text: str, out: ParsedDelta, closed: bool = True) -> None:
        # closed False: the token limit cut the call, whose arguments stay cut (finish)
        self._add_arguments(text, out, final=closed)
        self._xml = self._input = None
        self._mode, self._at_start, self._held_ws = _CONTENT, True, ""

    def _tool_call_in_reasoning(self, buf: str, j: int, i: int, out: ParsedDelta) -> bool:
        """`<tool_call>` at j inside the reasoning (`</think>` at i, or -1): a call if it closes before
        `</think>` and parses; held back while neither has come. True if the buffer was consumed."""
        k = buf.find(TOOL_CLOSE, j)
        if k < 0 or (0 <= i < k):
            if i >= 0:  # </think> came first: reasoning text, up to and with the </think> handled next
                out.add_reasoning(buf[:i])
                self._buf = buf[i:]
                return True
            out.add_reasoning(buf[:j])
            self._buf = buf[j:]
            return False
        end = k + len(TOOL_CLOSE)
        call = self._whole_call(buf[j + len(TOOL_OPEN) : k])
        if call is None:
            out.add_reasoning(buf[:end])
        else:
            out.add_reasoning(buf[:j])
            out.add_piece(ToolCallPiece.whole(self.n_tool_calls, call))
            self.n_tool_calls += 1
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
        out.add_content(stripped)

    def _whole_call(self, body: str) -> ToolCall | None:
        """A call parsed whole (parse_tool_call); a custom tool's with its input text."""
        call = parse_tool_call(body, self._schemas)
        if call is not None and call.name in self._custom:
            call.arguments, call.custom = _CustomInput().feed(call.arguments, final=True), True
        return call

    def _close_tool_call(
        self, body: str, out: ParsedDelta, closed: bool, cut: bool = False, close_cut: bool = False
    ) -> None:
        call = self._whole_call(body)
        self._mode, self._at_start = _CONTENT, True
        if call is None and cut:  # a whole call whose `</tool_call>` the cut split, else a call cut short
            call = self._whole_call(body[: len(body) - _partial_tag_len(body, (TOOL_CLOSE,))])
            call = call or self._cut_call(body, close_cut)
            if call is None and _call_head_cut(body):
                self._held_ws = ""
                return
        if call is None:
            raw = TOOL_OPEN + body + (TOOL_CLOSE if closed else "")
            self._at_start = False
            out.add_content(self._held_ws + raw)
            self._held_ws = ""
            return
        self._held_ws = ""
        out.add_piece(ToolCallPiece.whole(self.n_tool_calls, call))
        self.n_tool_calls += 1

    def _cut_call(self, body: str, close: bool) -> ToolCall | None:
        """A JSON-form call the token limit cut after its name (None before): its arguments as they were
        cut, or (close) the object of their whole members (_cut_json_object)."""
        head = _cut_json_call(body)
        if head is None:
            return None
        name, args = head
        # whole arguments: the text after them (the call's own brace, a split tag) left out
        if (whole := _leading_object(args := args.lstrip())) is not None:
            args = args[: whole[1]]
        if close:
            obj = _cut_json_object(args) if args.strip() else {}
            args = json.dumps(obj if obj is not None else {}, ensure_ascii=False)
        if name in self._custom:  # its input's head as json.dumps writes it, which _CustomInput reads
            args = _CUSTOM_HEAD.sub(_INPUT_HEAD, args, count=1)
            return ToolCall(name, _CustomInput().feed(args, final=close), custom=True)
        return ToolCall(name, args)


_CUT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*')
_CUSTOM_HEAD = re.compile(r'\A\s*\{\s*"input"\s*:\s*"')
_CUT_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _cut_json_call(body: str) -> tuple[str, str] | None:
    """(name, the arguments' text as it was cut) of a JSON-form call body cut short after its name:
    `{"name": "NAME"` then `, "arguments": ` and whatever of them came; None if the name is not whole."""
    m = _CUT_HEAD.match(body)
    if m is None:
        return None
    try:
        name, at = json.JSONDecoder().raw_decode(body, m.end())
    except ValueError:
        return None
    if not isinstance(name, str):
        return None
    m = _CUT_ARGS.match(body, at)
    if m is not None:
        return name, body[m.end() :]
    rest = re.sub(r"\s+", "", body[at:])  # cut before the arguments began: none came
    return (name, "") if any(k.startswith(rest) for k in (',"arguments":', ',"parameters":')) else None


def _call_head_cut(body: str) -> bool:
    """Whether a call body cut short ends before the call's name was whole, in either form (`{"na`,
    `<function=get_w`): what a cut call leaves when it is not yet a call."""
    s = body.strip()
    if _xml_head(s) is _UNDECIDED:  # (`<function=` not yet followed by `>`)
        return True
    t = re.sub(r"\s+", "", s)
    head = '{"name":"'
    return head.startswith(t) or (t.startswith(head) and '"' not in t[len(head) :])


def _leading_object(text: str) -> tuple[dict[str, Any], int] | None:
    """The whole JSON object `text` starts with and where it ends, if it starts with one."""
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        return None
    return (obj, end) if isinstance(obj, dict) else None


def _cut_json_object(text: str) -> dict[str, Any] | None:
    """The JSON object a text cut short opens, up to its last whole member (a string cut inside stays, cut,
    less an escape the cut split; a number or literal at the end is dropped, since more digits may have
    followed): the object if it is whole, else the text closed as it stands, else closed at its last `,` or
    opening bracket outside strings, then the one before, ...; None if it does not open an object."""
    if (whole := _leading_object(text.lstrip())) is not None:
        return whole[0]
    stack: list[str] = []
    ends: list[tuple[int, str]] = []  # (where the text may end, the closers it then needs)
    in_str = esc = False
    escape_at = -1  # where the string's last escape began
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc, escape_at = True, i
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            ends.append((i + 1, "".join(reversed(stack))))
        elif ch in "}]" and stack:
            stack.pop()
        elif ch == ",":
            ends.append((i, "".join(reversed(stack))))

    def candidates() -> Iterator[str]:  # made one at a time: the first nearly always parses
        if in_str:  # the string closed where it was cut, less an escape (or a surrogate pair) it split
            split = esc or (text[escape_at + 1 : escape_at + 2] == "u" and len(text) - escape_at < 6)
            kept = text[:escape_at] if split else text
            if (m := _HIGH_SURROGATE.search(kept)) and len(m.group(1)) % 2:  # (an odd run: an escape)
                kept = kept[: m.end() - 6]
            yield kept + '"' + "".join(reversed(stack))
        elif text.rstrip()[-1:] in ('"', "}", "]"):  # a number or literal at the end may be cut: not whole
            yield text + "".join(reversed(stack))
        for i, closers in reversed(ends):
            yield text[:i] + closers

    for candidate in candidates():
        try:
            obj = json.loads(candidate)
            json.dumps(obj, ensure_ascii=False).encode("utf-8")  # no lone surrogate in it
        except (ValueError, RecursionError):  # (UnicodeEncodeError is a ValueError)
            continue
        if isinstance(obj, dict):
            return obj
    return None


# a string's end that is a surrogate pair's first half, whose second the cut left out
_HIGH_SURROGATE = re.compile(r"(\\+)u[dD][89abAB][0-9a-fA-F]{2}\Z")


# How a custom tool's call begins: its input parameter (the only one the model is shown) as JSON text,
# as _XmlArguments and parse_tool_call (json.dumps' separators) write it
CUSTOM_PARAMETER = "input"
_INPUT_HEAD = '{"input": "'


class _CustomInput:
    """A custom tool's input text from its call's JSON arguments, fed as they stream in: the text of the
    `input` string as it becomes certain (an escape is held until whole), up to its closing quote (what
    follows it, another parameter, is ignored). Arguments of another shape are held to the end and read
    whole: a string that is the only parameter, whatever its name; no parameters, empty text; else the
    arguments' JSON text itself (nothing the model wrote is lost). The same text whatever the split."""

    def __init__(self) -> None:
        self.buf = ""
        self.state = "head"  # head: before the string; text: inside it; held: another shape; done

    def feed(self, text: str, final: bool = False) -> str:
        self.buf += text
        out = ""
        if self.state == "head":
            if self.buf.startswith(_INPUT_HEAD):
                self.buf, self.state = self.buf[len(_INPUT_HEAD) :], "text"
            elif not _INPUT_HEAD.startswith(self.buf):
                self.state = "held"
        if self.state == "text":
            out, self.buf, closed = _string_prefix(self.buf)
            if closed:
                self.state = "done"
        if self.state == "done":
            self.buf = ""
        if final:
            if self.state in ("head", "held"):
                out += _whole_input(self.buf)
            elif self.state == "text":  # the string never closed (the output was cut): what is left
                out += self.buf
            self.buf, self.state = "", "done"
        return out


def _string_prefix(s: str) -> tuple[str, str, bool]:
    """The text of a JSON string's body `s` (after its opening quote) that is certain, what is left of s
    (an escape not yet whole), and whether the string closed."""
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            return _unescape(s[:i]), "", True
        if c == "\\":
            size = 6 if s[i + 1 : i + 2] == "u" else 2
            if size == 6 and "d800" <= s[i + 2 : i + 6].lower() < "dc00":  # a pair's first half: its second?
                low = s[i + 6 : i + 12]
                if len(low) < 6 and _may_be_low_half(low):
                    break  # could still be the second half: wait for it
                if len(low) == 6 and _may_be_low_half(low):
                    size = 12
            if i + size > n:
                break
            i += size
        else:
            i += 1
    return _unescape(s[:i]), s[i:], False


def _may_be_low_half(p: str) -> bool:
    """`p` is (the start of) the escape of a surrogate pair's second half, `\\udc00`..`\\udfff`."""
    allowed = ("\\", "u", "d", "cdef", "0123456789abcdef", "0123456789abcdef")
    return all(c in ok for c, ok in zip(p.lower(), allowed, strict=False))


def _unescape(body: str) -> str:
    try:
        return json.loads('"' + body + '"')
    except ValueError:  # not JSON's escapes (never from json.dumps): as written
        return body


def _whole_input(arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    if not isinstance(args, dict):
        return arguments
    if isinstance(args.get(CUSTOM_PARAMETER), str):
        return args[CUSTOM_PARAMETER]
    if len(args) == 1 and isinstance(next(iter(args.values())), str):
        return next(iter(args.values()))
    return "" if not args else arguments


def _parameter_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name: JSON schema}, each parameter's types said outright
    (`{"type": [...]}`) where its schema implies them (typed_schema)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t.get("function") or {}
        params = fn.get("parameters") or {}
        props = (params.get("properties") or {}) if isinstance(params, dict) else None
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = {name: typed_schema(p, params) for name, p in props.items()}
    return out


def typed_schema(prop: Any, root: dict[str, Any]) -> Any:
    """A parameter's schema with its types said outright where they are implied: through a `$ref` into
    the tool's definitions, an `anyOf` / `oneOf` (pydantic's Optional[int]), an enum's or const's values;
    as it is where it says nothing of them (any value: text)."""
    types = schema_types(prop, root)
    return prop if None in types or (isinstance(prop, dict) and "type" in prop) else {"type": sorted(types)}


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"))


def schema_types(
    schema: Any, root: Any = None, depth: int = 0, refs: dict[str, set] | None = None
) -> set[str | None]:
    """The JSON types a value of `schema` may have; None among them: any (no type said, or a malformed
    one). root: the tool's parameters schema, whose `$defs` / `definitions` a local `$ref` names. Each
    `$ref` is followed once (refs: their types; a cycle reads as any type), so a request's schema costs
    its size, however its references repeat."""
    if not isinstance(schema, dict) or depth > 200:
        return {None}
    if "type" in schema:
        types = schema["type"]
        return {t if isinstance(t, str) else None for t in (types if isinstance(types, list) else [types])}
    refs = {} if refs is None else refs
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref not in refs:
            refs[ref] = {None}  # until known: a reference back to it (a cycle) is any type
            refs[ref] = schema_types(_resolve(ref, root), root, depth + 1, refs)
        return refs[ref]
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            return set().union(*(schema_types(m, root, depth + 1, refs) for m in members))
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    values = values if values is not None else [schema["const"]] if "const" in schema else []
    if values:
        return {"null" if v is None else "object" if isinstance(v, dict) else _json_type(v) for v in values}
    return {None}


def resolve_refs(schema: Any, root: Any) -> Any:
    """The schema a chain of local `$ref`s leads to (the schema itself without one; None if broken)."""
    for _ in range(16):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        schema = _resolve(schema["$ref"], root)
    return None


def _json_type(v: Any) -> str | None:
    return next((name for kind, name in _JSON_TYPES if isinstance(v, kind)), None)


def _resolve(ref: str, root: Any) -> Any:
    """A local `$ref` (`#/$defs/Name`, `#/definitions/Name`, any `#/a/b` path) in root; None if absent."""
    if not ref.startswith("#") or not isinstance(root, dict):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return node


def parse_tool_call(body: str, schemas: dict[str, dict[str, Any]] | None = None) -> ToolCall | None:
    """The text between `<tool_call>` and `</tool_call>` as a ToolCall, or None if it is neither form."""
    s = body.strip()
    if s.startswith("<function="):
        return _parse_xml(s, (schemas or {}))
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:  # a model that double-encodes its arguments: keep the string if it is a JSON object already
            inner = json.loads(args)
        except (ValueError, RecursionError):
            return None
        return ToolCall(obj["name"], args) if isinstance(inner, dict) else None
    if args is None:  # no arguments
        args = {}
    # arguments are an object (OpenAI's clients parse them as one, Anthropic's API requires one): anything
    # else is text, not a call
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _parse_xml(s: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    head = _xml_head(s)
    if not isinstance(head, tuple):
        return None
    name, at = head
    return ToolCall(name, _XmlArguments(schemas.get(name, {})).feed(s[at:], final=True))


_UNDECIDED = object()  # _xml_head: not enough text yet
_FUNCTION = "<function="
_PARAM, _PARAM_CLOSE, _FUNCTION_CLOSE = "<parameter=", "</parameter>", "</function>"
_XML_TAGS = (_PARAM_CLOSE, _PARAM, _FUNCTION_CLOSE)


def _xml_head(body: str) -> tuple[str, int] | object | None:
    """(name, offset after `<function=NAME>`) if the call body is the XML form; None if it is not;
    _UNDECIDED while its start could still be either."""
    s = body.lstrip()
    if not s.startswith(_FUNCTION):
        return _UNDECIDED if _FUNCTION.startswith(s) else None
    k, nl = s.find(">"), s.find("\n")
    if k < 0:
        return None if nl >= 0 else _UNDECIDED
    name = s[len(_FUNCTION) : k].strip()
    if (0 <= nl < k) or not name:
        return None
    return name, len(body) - len(s) + k + 1


class _XmlArguments:
    """An XML call's body (after `<function=NAME>`) -> its arguments as JSON text, fed as it streams in
    and returned in pieces: json.dumps of {parameter: value} as the whole body would give it (value types
    from the tool's schema, strings where it has none; the one newline the template puts on each side of
    a value dropped; a parameter ends at `</parameter>`, the next `<parameter=`, `</function>` or the end;
    text between parameters and after `</function>` ignored). A parameter given twice appears twice (what
    went out cannot be taken back): JSON parsers keep the last, as the whole-body dict does."""

    def __init__(self, props: dict[str, Any]) -> None:
        self.props = props
        self.buf = ""
        self.key: str | None = None  # the open parameter (None: between parameters)
        self.typed = False  # its value is held whole (a non-string schema type), else streamed
        self.tried = 0  # see _parameter
        self.lead = True  # its first character (a newline to drop) is still to come
        self.n = 0  # parameters opened
        self.done = False  # </function> seen

    def feed(self, text: str, final: bool = False, cut: bool = False) -> str:
        """The JSON text that became certain with `text`; final: the body ends here (the closing brace).
        cut: the token limit ended the output here, inside a tag perhaps: what may begin one is dropped."""
        self.buf += text
        if cut:
            self.buf = self.buf[: len(self.buf) - _partial_tag_len(self.buf, _XML_TAGS)]
        out = []
        while self.buf and not self.done:
            if not (self._parameter(out, final) if self.key is None else self._value(out, final)):
                break
        if final:
            if self.key is not None:
                self._value(out, final=True)
            out.append("}" if self.n else "{}")
        return "".join(out)

    def _parameter(self, out: list[str], final: bool) -> bool:
        """Between parameters: open the next one (True) or wait for more text."""
        i, j = self.buf.find(_PARAM), self.buf.find(_FUNCTION_CLOSE)
        start = i + len(_PARAM)
        k, nl = (self.buf.find(">", start), self.buf.find("\n", start)) if i >= 0 else (-1, -1)
        if j >= 0 and (i < 0 or j < i or k < 0 or k > j):  # the function ends (inside a tag too)
            self.done, self.buf = True, ""
            return False
        if i < 0:
            keep = 0 if final else _partial_tag_len(self.buf, (_PARAM, _FUNCTION_CLOSE))
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        if (0 <= nl and (k < 0 or nl < k)) or k == start:  # not a parameter tag: skip it
            self.buf = self.buf[start:]
            return True
        if k < 0:
            self.buf = "" if final else self.buf[i:]
            return False
        self.key, self.buf = self.buf[start:k].strip(), self.buf[k + 1 :]
        self.typed, self.lead = not is_text(self.props.get(self.key)), True
        self.tried = 0  # a typed value's tag positions below this were tried (not whole before them)
        out.append(("{" if self.n == 0 else ", ") + json.dumps(self.key, ensure_ascii=False) + ": ")
        out.append("" if self.typed else '"')
        self.n += 1
        return True

    def _value(self, out: list[str], final: bool) -> bool:
        """Inside a parameter's value: pass on what is certain; True when the parameter ended."""
        if self.lead and self.buf:
            self.buf, self.lead = (self.buf[1:] if self.buf.startswith("\n") else self.buf), False
        if self.typed:  # held whole in the buffer until it ends
            ends = self._typed_ends(final)
            if not ends and not final:
                return False
        else:
            ends = [(i, t) for t in (_PARAM_CLOSE, _PARAM, _FUNCTION_CLOSE) if (i := self.buf.find(t)) >= 0]
        if ends or final:
            e, tag = min(ends) if ends else (len(self.buf), "")
            piece = self.buf[:e]
            piece = piece[:-1] if piece.endswith("\n") else piece
            self.buf = self.buf[e + (len(tag) if tag == _PARAM_CLOSE else 0) :]
            self._take(piece, out, end=True)
            self.key = None
            return True
        keep = _partial_tag_len(self.buf, (_PARAM_CLOSE, _PARAM, _FUNCTION_CLOSE))
        if self.buf[: len(self.buf) - keep].endswith("\n"):
            keep += 1  # a newline right before the end is the template's, not the value's
        self._take(self.buf[: len(self.buf) - keep], out, end=False)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _typed_ends(self, final: bool) -> list[tuple[int, str]]:
        """A typed value ends at the first tag before which it is whole (JSON, or a boolean as Jinja
        writes it): a tag inside one of its JSON strings is text. One that never is (the model wrote no
        JSON) ends at its first tag, once the call ends."""
        tags = (_PARAM_CLOSE, _PARAM, _FUNCTION_CLOSE)
        ends = sorted((i, t) for t in tags for i in _find_all(self.buf, t))
        for i, tag in ends:
            if i < self.tried:  # the value is held whole in buf, which only grows: tried already
                continue
            piece = self.buf[:i]
            if _whole(piece[:-1] if piece.endswith("\n") else piece, self.props.get(self.key)):
                return [(i, tag)]
            self.tried = i + 1
        return ends[:1] if final else []

    def _take(self, text: str, out: list[str], end: bool) -> None:
        if self.typed:  # whole (_value holds it until it ends)
            out.append(json.dumps(_typed_value(text, self.props.get(self.key)), ensure_ascii=False))
            return
        out.append(json.dumps(text, ensure_ascii=False)[1:-1] + ('"' if end else ""))


def _find_all(text: str, tag: str) -> list[int]:
    out, i = [], text.find(tag)
    while i >= 0:
        out.append(i)
        i = text.find(tag, i + 1)
    return out


def _whole(value: str, schema: Any) -> bool:
    """A typed value as toolparse reads it is complete (_typed_value would not keep it as text)."""
    if "boolean" in schema_types(schema) and value.strip().lower() in ("true", "false"):
        return True
    try:
        json.loads(value)
    except (ValueError, RecursionError):
        return False
    return True


def is_text(schema: Any, root: Any = None) -> bool:
    """A parameter without a schema type, or one that may be a string, keeps its text as a string (as in
    vLLM's qwen3_coder parser). root: the tool's parameters schema (schema_types)."""
    return bool(schema_types(schema, root) & {None, "string"})


def _typed_value(value: str, schema: Any) -> Any:
    """The XML form carries every value as text; the tool's JSON schema says what it really is."""
    types = schema_types(schema)
    if is_text(schema):
        return value
    if "boolean" in types and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value
