"""OpenAI's Responses API (POST /v1/responses) over the chat machinery.

The request's `input` items become chat messages that the model's own template renders (`instructions` a
system message first; `function_call` and `custom_tool_call` items the assistant's tool calls;
`function_call_output` and `custom_tool_call_output` items tool results; `reasoning` items the next
assistant message's reasoning), sampled like a chat completion; the output parser's reasoning, text and
tool-call pieces become output items: a `reasoning` item, a `message` with one `output_text` part,
`function_call` items, `custom_tool_call` items (a custom tool's call: its input text). Streamed, each item
is opened, filled by deltas and closed in turn (`response.output_item.added`, `...output_text.delta` /
`...reasoning_text.delta` / `...function_call_arguments.delta` / `...custom_tool_call_input.delta`,
`...done`), between `response.created` and `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it), whose response holds exactly the streamed items.
lumo keeps its recent responses in memory (ResponseStore, unless a request's `store` is false; lost on
restart): a request's `previous_response_id` continues that response's conversation (its chain's input and
output items come before the new input; instructions are not carried over, as in OpenAI's API), and
GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items read and drop them; a `background`
response runs without a client, read with GET, stopped with POST /v1/responses/{id}/cancel. It keeps the
items of its recent responses too (ItemStore), so that an input's `item_reference` to one of them is that
item: the AI SDK's default OpenAI model sends earlier reasoning and messages so while `store` is not false.

What a text model cannot use but an agent's history holds is not refused (Codex CLI, served by a server
that refused it, would fail every later turn of the session): tools the API's servers run (web search,
file search, ...) are left out, as are their calls in the history; an image or a file in the input is a
short note saying it was left out; a system or developer message after the conversation started is a user
message (the family's templates take a system message only first).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from ..engine.llm import FLOAT32_MAX
from .chat import fold_system_messages, left_out
from .errors import APIError, loc_to_param
from .protocol import GUIDED, ChatCompletionRequest
from .toolparse import ParsedDelta

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The fields lumo honours; the API's others (metadata, user, truncation, reasoning's effort other than
    "none", ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    # no cap at 2 (OpenAI's API has one, vLLM's none): at most what the samplers' f32 division takes
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=FLOAT32_MAX, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # lumo/vLLM extension, as in the chat API
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: StrictBool | None = False
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: StrictBool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None  # false: this response is not kept (nor its items for item_reference)
    reasoning: dict[str, Any] | None = None  # effort "none": the template's enable_thinking false
    # set by to_chat: the name each tool is shown to the model under -> (its namespace or None, its name)
    _names: dict[str, tuple[str | None, str]] = PrivateAttr(default_factory=dict)
    _inputs: list[Any] = PrivateAttr(default_factory=list)  # set by to_chat: input_items(store)

    @property
    def tool_names(self) -> dict[str, tuple[str | None, str]]:
        return self._names

    def _template_kwargs(self) -> dict[str, Any] | None:
        """vLLM's chat_template_kwargs extension, as in chat; `reasoning.effort` "none" (OpenAI's "no
        reasoning") is Qwen's enable_thinking false unless those set it (other templates ignore it)."""
        kwargs = (self.model_extra or {}).get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            return kwargs  # what the chat request's validation refuses with a 400
        kwargs = dict(kwargs or {})
        if (self.reasoning or {}).get("effort") == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs or None

    @property
    def resolved_input(self) -> list[Any]:
        """The input's items as to_chat read them (ResponseStore.keep keeps these)."""
        return self._inputs

    def input_items(self, store: ItemStore | None = None) -> list[Any]:
        """The input as a list of items: a string is one user message; `store` resolves item references."""
        if isinstance(self.input, str):
            text = [{"type": "input_text", "text": self.input}]
            return [{"type": "message", "role": "user", "content": text}]
        return self.input if store is None else store.resolve(self.input)

    def to_chat(
        self, store: ItemStore | None = None, history: list[dict[str, Any]] | None = None
    ) -> ChatCompletionRequest:
        """The equivalent chat request (a 400 naming the field for what lumo cannot serve; the module's
        docstring says what is left out instead); `store` resolves the input's item references, `history`
        is the conversation `previous_response_id` continues (ResponseStore.history)."""
        for name in ("conversation", "prompt"):
            if getattr(self, name):
                msg = f"{name} is not supported: lumo keeps no conversations or prompts (send the input)"
                raise APIError(400, msg, name)
        if self.background and (self.store is False or self.stream):
            msg = "background needs store (a background response is read with GET), and no stream"
            raise APIError(400, msg, "background")
        if self.previous_response_id is not None and history is None:
            msg = "previous_response_id needs the server's response store"
            raise APIError(400, msg, "previous_response_id")
        fmt = text_format(self.text)
        kind = fmt["type"]
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(
                400, f"text.format {kind!r} is not supported (text, json_object, json_schema)", "text"
            )
        response_format = {"type": kind}  # the chat API's form (json_schema nested there, flat here)
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise APIError(400, "text.format json_schema needs schema, a JSON schema object", "text")
            response_format["json_schema"] = {"name": fmt.get("name"), "schema": fmt["schema"]}
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        tools, kept, self._names = _chat_tools(self.tools or [])
        shown = {origin: name for name, origin in self._names.items()}
        self._inputs = self.input_items(store)
        chained = {item.get("id") for item in history or () if isinstance(item, dict)}
        for i, item in enumerate(self._inputs):  # (an item_reference is the item it names by now)
            if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"] in chained:
                msg = f"Duplicate item found with id {item['id']!r}: previous_response_id's chain has it"
                raise APIError(400, msg, f"input[{i}]")
        items, origin = _messages([*(history or ()), *self._inputs], shown, first=len(history or ()))
        origin = [[_INSTRUCTIONS]] * len(messages) + origin
        messages += items
        # Codex CLI sends developer messages first (with or without instructions), and more when its
        # settings change mid-session
        lead = fold_system_messages(messages)
        origin[:lead] = origin[: min(lead, 1)]
        if not messages:
            raise APIError(400, "input must not be empty", "input")
        body = {
            "messages": messages,
            "tools": tools or None,
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": None if kind == "text" else response_format,
            # vLLM's structured-output fields, sent as extras (the Responses API has none of its own)
            **{name: (self.model_extra or {}).get(name) for name in ("structured_outputs", *GUIDED)},
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "chat_template_kwargs": self._template_kwargs(),
        }
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            loc = tuple(err["loc"])
            if loc[:1] == ("tools",) and len(loc) > 1 and isinstance(loc[1], int):
                loc = ("tools", kept[loc[1]], *loc[2:])
            param = loc_to_param(_item_loc(loc, origin)) or "input"
            raise APIError(400, f"{param}: {err['msg']}", param.split(".")[0].split("[")[0]) from None
        try:
            chat.check_supported()
        except APIError as e:  # a tool's index among the chat's tools -> among the request's
            if e.param and (m := re.fullmatch(r"tools\[(\d+)\]", e.param)):
                e.param = f"tools[{kept[int(m[1])]}]"
            raise
        return chat


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a Responses request whose input is counted, not answered (the input
    may be left out when previous_response_id gives the conversation)."""

    input: str | list[dict[str, Any]] = Field(default_factory=list)


class ItemStore:
    """The items of this server's recent responses by id (their output, and the input items that carry an
    id), for an input's `item_reference`: in memory, the newest `max_items` within `max_bytes` of JSON,
    lost on restart (a reference to an item it no longer has is a 400 that says so). Used from the event
    loop only."""

    def __init__(self, max_items: int = 16384, max_bytes: int = 64 << 20) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._bytes = 0

    def keep(self, items: Any) -> None:
        """Remember the items (objects with a string `id`; an item_reference is not an item)."""
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, dict) or not isinstance(item.get("id"), str):
                continue
            if item.get("type") == "item_reference":
                continue
            if item["id"] in self._items:  # an agent sends its history again every turn: kept once
                self._items.move_to_end(item["id"])
                continue
            text = json.dumps(item)
            if len(text) > self.max_bytes:
                continue
            self._bytes += len(text)
            self._items[item["id"]] = (json.loads(text), len(text))
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                self._bytes -= self._items.popitem(last=False)[1][1]

    def resolve(self, items: list[Any]) -> list[Any]:
        """The input with each `item_reference` replaced by the item it names."""
        out = []
        for i, item in enumerate(items):
            if isinstance(item, dict) and item.get("type") == "item_reference":
                ref = item.get("id")
                kept = self._items.get(ref) if isinstance(ref, str) else None
                if kept is None:
                    raise APIError(
                        400,
                        f"input[{i}]: item {ref!r} is not known: lumo keeps the items of its recent "
                        "responses in memory only; send the item itself (the AI SDK: "
                        "providerOptions.openai.store = false)",
                        f"input[{i}]",
                    )
                self._items.move_to_end(ref)
                item = _copy(kept[0])
            out.append(item)
        return out


class ResponseStore:
    """This server's recent responses by id, for `previous_response_id` and GET / DELETE
    /v1/responses/{id}: each response with its input items (references resolved, ids given) and the id of
    the response it continued, so a conversation is a chain of them. In memory, lost on restart: the newest
    `max_responses` within `max_bytes` of JSON, least recently used out first; continuing a conversation
    uses its whole chain again, so a conversation in use keeps its earlier turns. Used from the event loop
    only."""

    def __init__(self, max_responses: int = 4096, max_bytes: int = 256 << 20) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        # id -> (response, its input items, the previous response's id, bytes)
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[Any], str | None, int]] = OrderedDict()
        self._bytes = 0

    def keep(self, response: dict[str, Any], inputs: list[Any]) -> None:
        """Keep the response; in place of one kept under its id (a background response's end), with the
        input items (and ids) kept with that one."""
        before = self._kept.pop(response["id"], None)
        if before is not None:
            self._bytes -= before[3]
        inputs = before[1] if before is not None else _listed_items(inputs)
        size = len(json.dumps(response)) + len(json.dumps(inputs))
        if size > self.max_bytes:
            return
        self._kept[response["id"]] = (_copy(response), inputs, response.get("previous_response_id"), size)
        self._bytes += size

        # least recently used out first; a background response not yet ended stays (it can be stopped)
        def over() -> bool:
            return len(self._kept) > self.max_responses or self._bytes > self.max_bytes

        evictable = [rid for rid, kept in self._kept.items() if not _pending(kept[0])] if over() else []
        for rid in evictable:
            self._bytes -= self._kept.pop(rid)[3]
            if not over():
                break

    def get(self, response_id: str) -> dict[str, Any]:
        """The response as it was returned (a 404 if it is not kept)."""
        return _copy(self._entry(response_id)[0])

    def input_items(self, response_id: str) -> list[Any]:
        """The response's own input items, oldest first (not those of the responses it continued)."""
        return _copy(self._entry(response_id)[1])

    def delete(self, response_id: str) -> None:
        self._entry(response_id)
        self._bytes -= self._kept.pop(response_id)[3]

    def history(self, response_id: str) -> list[Any]:
        """The conversation up to and with the response: each response of its chain, oldest first, its
        input items then its output items (a 400 naming previous_response_id if one is not kept)."""
        chain: list[str] = []
        rid: str | None = response_id
        while rid is not None:
            if rid not in self._kept:
                what = "is not" if rid == response_id else f"continues {rid!r}, which is no longer"
                msg = (
                    f"previous response {response_id!r} {what} kept: lumo keeps its recent responses in "
                    "memory only (send the whole conversation as input)"
                )
                raise APIError(400, msg, "previous_response_id", "previous_response_not_found")
            if _pending(self._kept[rid][0]):
                msg = f"previous response {rid!r} has not ended yet (a background response: poll it with GET)"
                raise APIError(400, msg, "previous_response_id")
            chain.append(rid)
            rid = self._kept[rid][2]
        items: list[Any] = []
        for rid in reversed(chain):
            self._kept.move_to_end(rid)
            response, inputs = self._kept[rid][:2]
            items += _copy(inputs) + _copy(response["output"])
        return items

    def _entry(self, response_id: str) -> tuple[dict[str, Any], list[Any], str | None, int]:
        kept = self._kept.get(response_id)
        if kept is None:
            msg = f"response {response_id!r} not found (lumo keeps its recent responses in memory only)"
            raise APIError(404, msg, "response_id", "not_found")
        return kept


def _pending(response: dict[str, Any]) -> bool:
    """A background response not yet ended."""
    return response.get("status") in ("queued", "in_progress")


# an item type -> the prefix of the ids lumo gives such items
_ID_PREFIX = {"message": "msg", "function_call": "fc", "custom_tool_call": "ctc", "reasoning": "rs"}


def _listed_items(items: list[Any]) -> list[Any]:
    """Input items as GET .../input_items lists them (the API's item objects, each with an id of its own,
    which the history's rendering reads as it read the items sent): a message's string content as one
    text part (an assistant's output_text, with its status), `type` and a call's or output's `status` set
    where the client left them out, an id given where it sent none or one used before in this input."""
    out, seen = _copy(items), set()
    for item in out:
        kind = item.setdefault("type", "message")
        if not isinstance(item.get("id"), str) or item["id"] in seen:
            item["id"] = new_id(_ID_PREFIX.get(kind, "item"))
        seen.add(item["id"])
        if kind == "message":
            assistant = item.get("role") == "assistant"
            if isinstance(item.get("content"), str):
                part = "output_text" if assistant else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            for part in item["content"] if isinstance(item.get("content"), list) else ():
                if isinstance(part, dict) and part.get("type") == "output_text":
                    part.setdefault("annotations", [])
            if assistant:
                item.setdefault("status", "completed")
        elif kind in ("function_call", "custom_tool_call", "function_call_output", "custom_tool_call_output"):
            item.setdefault("status", "completed")
    return out


# the chat request's fields under their Responses names (a validation error names the request's own)
_RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
# a chat message's fields under their input items' names
_ITEM_NAMES = {"tool_call_id": "call_id", "id": "call_id", "function": None, "custom": None}


def _item_loc(loc: tuple[Any, ...], origin: list[list[int]]) -> tuple[Any, ...]:
    """A chat request's error location in the Responses request's terms: a message's fields are its input
    item's (origin: _messages'), a merged tool call's those of its own function_call item."""
    if len(loc) > 1 and loc[0] == "messages" and isinstance(loc[1], int) and loc[1] < len(origin):
        items, rest = origin[loc[1]], loc[2:]
        item = items[0]
        call = rest[1] if rest[:1] == ("tool_calls",) and len(rest) > 1 else None
        if isinstance(call, int) and call + 1 < len(items):
            item, rest = items[call + 1], rest[2:]
        if item == _INSTRUCTIONS:
            return ("instructions",)
        if item == _HISTORY:
            return ("previous_response_id",)
        named = (_ITEM_NAMES.get(p, p) if isinstance(p, str) else p for p in rest)
        return ("input", item, *(p for p in named if p is not None))
    return tuple(_RESPONSES_NAMES.get(p, p) if i == 0 else p for i, p in enumerate(loc))


def text_format(text: Any) -> dict[str, Any]:
    """The request's `text.format` (`{"type": "text"}` when absent), checked to be an object with a type."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type", "text"), str):
        msg = "text.format must be an object with a type (text, json_object, json_schema)"
        raise APIError(400, msg, "text")
    return {"type": "text", **fmt}


# an input part lumo's models cannot read -> the note that stands in for it
_LEFT_OUT = {
    "input_image": left_out("an image"),
    "input_file": left_out("a file"),
    "input_audio": left_out("audio"),
}
# tools the API's own servers run, which lumo cannot: left out of the tools, their calls out of the input
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
    }
)
_HOSTED_CALLS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
    }
)


def _text_of(content: Any, where: str, field: str = "content") -> str:
    """A message's text (or a tool output's: field "output"): a string, or its parts' texts one per line
    (vLLM joins a chat message's parts so); an assistant's `refusal` part is its text (as in chat); an
    image, file or audio part is a note that it was left out; any other part is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.{field} must be a string or a list of parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.{field}[{j}]"
        if isinstance(kind, str) and kind in _LEFT_OUT:
            parts.append(_LEFT_OUT[kind])
        elif kind in _TEXT_PARTS or kind == "refusal":
            key = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(key), str):
                raise APIError(400, f"{at}: the {kind} part needs `{key}`, a string", at)
            parts.append(part[key])
        else:
            raise APIError(400, f"content part type {kind!r} is not supported (text only)", at)
    return "\n".join(parts)


# an item's origin (_messages) when it is not one of the input's: the instructions, the conversation
# previous_response_id continues
_INSTRUCTIONS, _HISTORY = -1, -2


def _messages(
    items: list[dict[str, Any]], shown: dict[tuple[str | None, str], str] | None = None, first: int = 0
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The items as chat messages, and each message's origin: the input item it came from, then its
    tool calls' items (function_call items merge into one assistant message, which a message item may
    open; a reasoning item goes into the message after it); the items before `first` are the history
    previous_response_id continues (origin _HISTORY). shown: (namespace, name) -> the name the tool is
    shown under (_chat_tools), for calls of a namespace's tools."""
    out: list[dict[str, Any]] = []
    origin: list[list[int]] = []
    reasoning = None  # a reasoning item's text, for the assistant message that follows it
    for n, item in enumerate(items):
        i = n - first if n >= first else _HISTORY
        where = f"input[{i}]" if n >= first else "previous_response_id"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    400, f"{where}.role {role!r} is not user, assistant, system or developer", where
                )
            msg = {"role": role, "content": _text_of(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"] = reasoning
            reasoning = None
            out.append(msg)
            origin.append([i])
        elif kind in ("function_call", "custom_tool_call"):
            call: dict[str, Any] = {"id": item.get("call_id")}
            name, namespace = item.get("name"), item.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise APIError(400, f"{where}.namespace must be a string", where)
            if isinstance(name, str):
                name = (shown or {}).get((namespace, name), name)
            if kind == "function_call":
                call["type"] = "function"
                call["function"] = {"name": name, "arguments": item.get("arguments", "{}")}
            else:
                call["type"] = "custom"
                call["custom"] = {"name": name, "input": item.get("input")}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":  # the calls' own assistant message
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                out.append(last)
                origin.append([i])
            last.setdefault("tool_calls", []).append(call)
            origin[-1].append(i)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            reasoning = None  # reasoning belongs to the assistant turn right after it
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where, "output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
            origin.append([i])
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            parts = [{"text": parts}] if isinstance(parts, str) else parts
            ok = isinstance(parts, list)
            texts = [p.get("text", "") for p in parts if isinstance(p, dict)] if ok else []
            if not ok or not all(isinstance(t, str) for t in texts):
                raise APIError(400, f"{where}: a reasoning item's content is a list of text parts", where)
            reasoning = "".join(texts)
        elif not (isinstance(kind, str) and kind in _HOSTED_CALLS):  # a hosted tool's call: left out
            raise APIError(400, f"input item type {kind!r} is not supported", where)
    return out, origin


def _chat_tools(
    tools: list[Any],
) -> tuple[list[dict[str, Any]], list[int], dict[str, tuple[str | None, str]]]:
    """The request's tools as chat tools: hosted ones left out, a namespace's tools (Codex CLI groups its
    sub-agent tools so) each a tool of its own, shown to the model under its own name unless another tool
    has it too (then `NAMESPACE__NAME`). Also each chat tool's index among the request's tools (errors name
    those) and each shown name -> (its namespace or None, its name)."""
    flat: list[tuple[int, str | None, Any]] = []
    for i, t in enumerate(tools):
        if isinstance(t, dict) and t.get("type") == "namespace":
            if not isinstance(t.get("name"), str) or not isinstance(t.get("tools"), list):
                raise APIError(400, "a namespace tool needs a name and a list of tools", f"tools[{i}]")
            for j, member in enumerate(t["tools"]):
                if not isinstance(member, dict):
                    raise APIError(400, f"tools[{i}].tools[{j}] must be an object", f"tools[{i}]")
                flat.append((i, t["name"], member))
        else:
            flat.append((i, None, t))
    count: dict[Any, int] = {}
    for _, _, t in flat:
        name = t.get("name") if isinstance(t, dict) and isinstance(t.get("name"), str) else None
        count[name] = count.get(name, 0) + 1
    out, index, names = [], [], {}
    for i, namespace, t in flat:
        chat = _chat_tool(i, t)
        if chat is None:
            continue
        spec = chat[chat["type"]]
        name = spec["name"]
        if namespace is not None and count[name] > 1:
            spec["name"] = f"{namespace}__{name}"
        taken = names.get(spec["name"])
        if taken is not None and (namespace is not None or taken[0] is not None):
            # a namespace's tool meets another of its shown name (a namespace twice, NS__NAME given too)
            raise APIError(400, f"tool name {spec['name']!r} is used twice", f"tools[{i}]")
        out.append(chat)
        index.append(i)
        names[spec["name"]] = (namespace, name)
    return out, index, names


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any] | None:
    """A Responses function tool (flat: name, description, parameters) or custom tool (flat: name,
    description, format; a grammar format flat too: syntax, definition) as a chat tool; None for a hosted
    tool (left out)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if isinstance(kind, str) and kind in HOSTED_TOOLS:
        return None
    if kind not in ("function", "custom"):
        msg = f"tool type {kind!r} is not supported (function and custom tools; hosted ones are left out)"
        raise APIError(400, msg, f"tools[{i}]")
    if not isinstance(tool.get("name"), str):
        raise APIError(400, f"a {kind} tool needs a name, a string", f"tools[{i}]")
    if kind == "function":
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        return {"type": "function", "function": fn}
    custom = {k: tool[k] for k in ("name", "description") if tool.get(k) is not None}
    fmt = tool.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise APIError(400, "a custom tool's format is an object (type text or grammar)", f"tools[{i}]")
        grammar = {k: fmt[k] for k in ("syntax", "definition") if k in fmt}
        custom["format"] = {"type": fmt.get("type"), **({"grammar": grammar} if grammar else {})}
    return {"type": "custom", "custom": custom}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind not in ("function", "custom"):
            raise APIError(400, f"tool_choice type {kind!r} is not supported", "tool_choice")
        return {"type": kind, kind: {"name": choice.get("name")}}
    return choice


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """A response's output items from the chat parser's deltas, in order, and the streamed events that
    open, fill and close them: `feed(delta)` and `finish()` (closes the last item) return the events."""

    def __init__(self, head: dict[str, Any], names: dict[str, tuple[str | None, str]] | None = None) -> None:
        self.head = head  # the response object's fields that do not depend on the output
        self.names = names or {}  # a tool's shown name -> (its namespace, its name): ResponsesRequest's
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being filled: always the last one
        self.seq = 0

    def response(self, status: str, usage: dict[str, Any] | None = None, reason: str | None = None) -> dict:
        out = {**self.head, "status": status, "output": _copy(self.items), "usage": usage}
        out["incomplete_details"] = {"reason": reason} if reason else None
        return out

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def feed(self, d: ParsedDelta) -> list[dict[str, Any]]:
        """The delta's parts in the order they came: text to a reasoning or message item, a tool call's
        first piece opens its item, later pieces add to its arguments."""
        events: list[dict[str, Any]] = []
        for kind, value in d.parts:
            if kind != "tool":
                events += self._text("reasoning" if kind == "reasoning" else "message", value)
                continue
            if value.id is not None:  # a new call: its own item
                events += self._close()
                if value.custom:  # a custom tool's call has no status
                    item = {"type": "custom_tool_call", "id": new_id("ctc"), "input": ""}
                else:
                    item = {"type": "function_call", "id": new_id("fc"), "arguments": ""}
                    item["status"] = "in_progress"
                namespace, name = self.names.get(value.name, (None, value.name))
                item.update(call_id=value.id, name=name, **({"namespace": namespace} if namespace else {}))
                events += self._add(item)
            if value.arguments:
                field, kind = _CALL_FIELDS[self.open["type"]]
                self.open[field] += value.arguments
                events.append(self._on_open(f"response.{kind}.delta", delta=value.arguments))
        return events

    def finish(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the last item (`incomplete` when max_output_tokens cut the response)."""
        return self._close(status)

    def _on_open(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event about the open item."""
        return self.event(kind, item_id=self.open["id"], output_index=len(self.items) - 1, **fields)

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for a reasoning or message item: the open one, or a new one (the open item closed)."""
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": new_id("msg"), "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": []}
            events += self._add({**item, "status": "in_progress"})
            self.open["content"].append(part)
            events.append(self._on_open("response.content_part.added", content_index=0, part=_copy(part)))
        self.open["content"][0]["text"] += text
        if kind == "reasoning":
            events.append(self._on_open("response.reasoning_text.delta", content_index=0, delta=text))
        else:
            events.append(
                self._on_open("response.output_text.delta", content_index=0, delta=text, logprobs=[])
            )
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        if item["type"] in _CALL_FIELDS:
            field, kind = _CALL_FIELDS[item["type"]]
            if "status" in item:
                item["status"] = status
            events = [self._on_open(f"response.{kind}.done", **{field: item[field]})]
        else:
            item["status"] = status
            part = item["content"][0]
            if item["type"] == "reasoning":
                events = [self._on_open("response.reasoning_text.done", content_index=0, text=part["text"])]
            else:
                done = dict(content_index=0, text=part["text"], logprobs=[])
                events = [self._on_open("response.output_text.done", **done)]
            events.append(self._on_open("response.content_part.done", content_index=0, part=_copy(part)))
        events.append(
            self.event("response.output_item.done", output_index=len(self.items) - 1, item=_copy(item))
        )
        self.open = None
        return events


# a call item's type -> the field its deltas fill and their events' name
_CALL_FIELDS = {
    "function_call": ("arguments", "function_call_arguments"),
    "custom_tool_call": ("input", "custom_tool_call_input"),
}


def _copy(x: Any) -> Any:
    """A deep copy of JSON data (events must not change as the items they describe grow)."""
    return json.loads(json.dumps(x))


def response_head(body: ResponsesRequest, served_name: str) -> dict[str, Any]:
    """The response object's fields that do not depend on the output; the request's values it echoes
    (instructions, tools, tool_choice, text, metadata, reasoning) must be JSON a response can carry: a
    lone surrogate or a NaN / Infinity in them is a 400 naming the field (echoed, they would break it)."""
    for name in ("instructions", "tools", "tool_choice", "text", "metadata", "reasoning"):
        try:
            json.dumps(getattr(body, name), ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (ValueError, UnicodeEncodeError):
            msg = f"{name} holds a value JSON text cannot carry (a lone surrogate, NaN or Infinity)"
            raise APIError(400, msg, name) from None
    return {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": served_name,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "background": bool(body.background),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "text": {"format": _copy(text_format(body.text))},
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "reasoning": _copy(body.reasoning),  # as asked (its effort "none" turned thinking off)
        "error": None,
    }


def response_usage(n_prompt: int, n_gen: int, cached: int, reasoning: int) -> dict[str, Any]:
    """usage; reasoning: the reasoning text's length in tokens (encoded again: the engine does not tell
    which generated tokens were reasoning)."""
    return {
        "input_tokens": n_prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": n_gen,
        "output_tokens_details": {"reasoning_tokens": min(reasoning, n_gen)},
        "total_tokens": n_prompt + n_gen,
    }
