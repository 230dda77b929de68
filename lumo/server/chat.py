"""Chat requests -> prompt text (the model's own template), and chat output -> OpenAI message fields."""

from __future__ import annotations

import json
from typing import Any

from ..engine.grammar import LEAD, StructuredOutputs
from ..tokenizer import TokenizerError
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from .toolparse import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    ParsedDelta,
    ToolCall,
    ToolCallPiece,
    is_text,
    resolve_refs,
    schema_types,
)


def _text(i: int, content: str | list[dict[str, Any]] | None) -> str | None:
    """A message's text: its text parts one per line; an image, audio, file or video part is a note that
    it was left out (an agent that once read an image keeps it in its history, and a 400 would fail every
    later turn: Cline ended its session so); any other part is a 400."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        kind, where = part.get("type"), f"messages[{i}].content[{j}]"
        if isinstance(kind, str) and kind in _LEFT_OUT:
            parts.append(_LEFT_OUT[kind])
            continue
        if kind == "refusal" and isinstance(part.get("refusal"), str):  # an assistant's refusal: its text
            parts.append(part["refusal"])
            continue
        if kind != "text":
            raise APIError(400, f"content part type {kind!r} is not supported (text only)", where)
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: a text part needs `text`, a string", where)
        parts.append(part["text"])
    return "\n".join(parts)  # one per line, as vLLM joins a message's parts


def _arguments(args: str | dict[str, Any]) -> str | dict[str, Any]:
    # templates iterate over arguments (Qwen3-coder: `arguments|items`), so hand them the parsed object
    if isinstance(args, str):
        try:
            obj = json.loads(args)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: text
            return args
        return obj if isinstance(obj, dict) else args
    return args


def left_out(what: str) -> str:
    """The note that stands in a prompt for an input part lumo's text models cannot read (an image, a
    document...), where the APIs take one rather than refuse it."""
    return f"[{what} was left out: this model reads text only]"


# a chat content part lumo's models cannot read -> the note that stands in for it (vLLM's video_url too)
_LEFT_OUT = {
    "image_url": left_out("an image"),
    "input_audio": left_out("audio"),
    "file": left_out("a file"),
    "video_url": left_out("a video"),
}


def fold_system_messages(messages: list[dict[str, Any]]) -> int:
    """In place, for APIs whose clients put system text anywhere (the Responses API's instructions and
    developer messages, the Messages API's `system` and system messages): the system / developer messages
    before any other are one system message, first (joined by blank lines), and a later one is a user
    message where it stands (the family's templates take one system message, first; a later one folded
    into the first would change the prompt's prefix, and the prefix cache would miss). Returns how many
    leading messages became the first."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    if lead > 1:
        messages[:lead] = [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])}]
    for m in messages[1:]:
        if m["role"] in ("system", "developer"):
            m["role"] = "user"
    return lead


def template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    content = _text(i, m.content)
    if content is None and role in ("system", "user", "tool"):
        raise APIError(400, f"messages[{i}] ({m.role}) needs content", f"messages[{i}].content")
    if content is None and not m.tool_calls:
        raise APIError(
            400, f"messages[{i}] (assistant) needs content or tool_calls", f"messages[{i}].content"
        )
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content or m.reasoning:
        out["reasoning_content"] = m.reasoning_content or m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    return out


def forced_tool_calls(tokenizer: Any, req: ChatCompletionRequest) -> StructuredOutputs | None:
    """tool_choice "required" or a named function, enforced as a grammar (vLLM enforces both with its
    structured outputs): the output after any reasoning is one tool call of an allowed function, or several
    (one per line) unless parallel_tool_calls is false, in the form the chat template teaches: Qwen3-coder /
    Qwen3.5's XML when the template mentions `<function=`, Qwen3's JSON otherwise; up to two spaces or
    newlines may come first (Qwen writes "\n\n" after `</think>`; more would let a model pad forever).
    A JSON call's arguments follow the tool's parameters schema (its own, so its `$ref`s resolve;
    json.dumps' separators, as the templates write calls; llguidance's lenient mode: keywords it does not
    know are ignored, as the model's template would). An XML call follows it too (_xml_call_rules).
    A custom tool is its function (custom_function): in the XML form its input text follows the tool's
    grammar, if it has one (_custom_grammars); in the JSON form a regular expression's (the input string's
    `pattern`, anchored), while a Lark grammar's input there is any JSON string.
    None for "auto", "none" or no choice."""
    choice = req.tool_choice
    if not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    tools = req.tools or []
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function["name"]]
    functions = [t.function for t in tools]
    source = tokenizer.chat_template_source(tools=True) or ""
    if "<function=" in source:
        rules = _xml_call_rules(functions, _custom_grammars(tools))
    else:
        patterns = {t.function.name: t.custom.format.grammar for t in tools if t.type == "custom"}
        patterns = {k: g.definition for k, g in patterns.items() if g is not None and g.syntax == "regex"}
        rules = _json_call_rules(functions, patterns)
    opening, closing = (_lark_tag(tokenizer, tag) for tag in (TOOL_OPEN, TOOL_CLOSE))
    calls = "call" if req.parallel_tool_calls is False else 'call ("\\n" call)*'
    head = [f"start: {LEAD}? {calls}", f'call: {opening} "\\n" body "\\n" {closing}']
    return StructuredOutputs(grammar="\n".join(head + rules))


def _lark_tag(tokenizer: Any, tag: str) -> str:
    """A tag in llguidance's Lark: its token (`<[id]>`) when the vocabulary has it as one (Qwen's added
    `<tool_call>` tokens: a text literal would have to spell it in ordinary tokens), else its text."""
    i = tokenizer.token_to_id(tag)
    return f"<[{i}]>" if i is not None else json.dumps(tag)


# llguidance's JSON options for a call's arguments: JSON as json.dumps and Jinja's tojson write it (what the
# templates show the model), and keywords llguidance does not know ignored.
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}


def _json_rule(schema: dict[str, Any]) -> str:
    own = schema.get("x-guidance") or {}
    if not isinstance(own, dict):
        raise APIError(400, f"a tool's x-guidance must be an object, got {type(own).__name__}", "tools")
    options = {**own, **_JSON_OPTIONS}
    return f"%json {json.dumps({**schema, 'x-guidance': options})}"


def _json_call_rules(functions: list, patterns: dict[str, str] | None = None) -> list[str]:
    """`{"name": "f", "arguments": ARGS}`, ARGS each tool's parameters schema in a %json rule of its own.
    patterns: function name -> the regular expression its one parameter's string matches whole (a custom
    tool's: custom_function)."""
    rules = ["body: " + " | ".join(f"c{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        schema = f.parameters if isinstance(f.parameters, dict) else {}
        schema = schema if "type" in schema else {"type": "object", **schema}  # arguments are an object
        if f.name in (patterns or {}):
            ((param, prop),) = schema["properties"].items()
            prop = {**prop, "pattern": f"^(?:{patterns[f.name]})$"}
            schema = {**schema, "properties": {param: prop}, "additionalProperties": False}
        head = '{"name": ' + json.dumps(f.name) + ', "arguments": '
        rules += [f'c{i}: {json.dumps(head)} a{i} "}}"', f"a{i}: {_json_rule(schema)}"]
    return rules


# An XML parameter's value: text, then "\n</parameter>\n"; no tag inside that ends a value or the call
# early in toolparse (`</parameter>`, `<parameter=`, `</function>`, `</tool_call>`).
_XML_VALUE = (
    r"value[lazy]: /(?s:.*)\n<\/parameter>\n/"
    r" & ~/(?s:.*)(<\/parameter>|<parameter=|<\/function>|<\/tool_call>)(?s:.*)<\/parameter>\n/"
)
_XML_END_TEXT = "\n</parameter>\n"  # a value's end
_XML_END = json.dumps(_XML_END_TEXT)  # in Lark


def _custom_grammars(tools: list) -> dict[str, tuple[str, str]]:
    """Custom tool name -> (syntax, Lark text) of its input, for the tools with a grammar: a Lark grammar
    (_xml_call_rules nests it, `%lark {...}`, before the value's end), or a regular expression as the body
    of a lexeme (which ends lazily at the value's end, a `suffix`: a greedy lexeme such as `[^/]+` would run
    on into it and never end). A nested grammar takes no such attribute, so a Lark grammar whose last
    terminal can take the end's text (`/(.|\\n)*/`) cannot end the call; Codex CLI's patch grammar ends
    its lines at newlines."""
    out = {}
    for t in tools:
        grammar = t.custom.format.grammar if t.type == "custom" else None
        if grammar is None:
            continue
        text = grammar.definition if grammar.syntax == "lark" else f"/{_slashes_escaped(grammar.definition)}/"
        out[t.function.name] = (grammar.syntax, text)
    return out


def _slashes_escaped(regex: str) -> str:
    """A regular expression as the body of a Lark `/.../` lexeme: its unescaped slashes escaped."""
    out, escaped = [], False
    for c in regex:
        out.append("\\/" if c == "/" and not escaped else c)
        escaped = c == "\\" and not escaped
    return "".join(out)


def _xml_call_rules(functions: list, grammars: dict[str, tuple[str, str]] | None = None) -> list[str]:
    """`<function=NAME>\n`, its parameters (`<parameter=P>\nVALUE\n</parameter>\n` each), `</function>`.
    Where the tool's schema lists properties, its parameters are those, in the schema's order (llguidance
    orders a JSON object's properties so too), each at most once and every required one present; a value
    is what toolparse will read for its schema: JSON of it where no string is among its types (an integer,
    an object ...; a boolean also as Jinja writes it, `True` / `False`), one of a string enum's (or
    const's) texts, else text (_XML_VALUE). A parameter's types are toolparse's (schema_types: its `type`,
    or those a `$ref`, an `anyOf` / `oneOf` or an enum's values imply, so pydantic's Optional[int] is JSON
    and a `$ref` to a string enum one of its texts). Parameters the listed properties leave out are refused
    (as OpenAI's strict mode would). Without listed properties: any names, text values. A name that the form
    cannot carry (a `>`, a newline, blanks at its ends) is a 400. grammars: function name -> the Lark
    grammar its one parameter's text follows (a custom tool's: _custom_grammars)."""
    functions_alt = " | ".join(f"f{i}" for i in range(len(functions)))
    rules = [f'body: "<function=" ({functions_alt}) "</function>"']
    for i, f in enumerate(functions):
        schema = f.parameters if isinstance(f.parameters, dict) else {}
        props, head = schema.get("properties"), json.dumps(f.name + ">\n")
        for name in [f.name, *(props if isinstance(props, dict) else ())]:
            if not name or name != name.strip() or any(c in name for c in ">\n"):
                msg = f"tool {f.name!r}: the name {name!r} cannot be written in the template's XML call form"
                raise APIError(400, msg, "tools")
        if f.name in (grammars or {}):
            (param,) = props  # custom_function's one parameter
            opening, (syntax, text) = json.dumps(f"<parameter={param}>\n"), grammars[f.name]
            if syntax == "lark":
                rules += [f"f{i}: {head} {opening} g{i} {_XML_END}", f"g{i}: %lark {{\n{text}\n}}"]
            else:  # a lexeme, lazily ended by the value's end
                rules += [f"f{i}: {head} {opening} g{i}", f"g{i}[suffix={_XML_END}]: {text}"]
            continue
        if not isinstance(props, dict):
            rules += [f"f{i}: {head} p{i}*", f'p{i}: "<parameter=" /[^>\\n]+/ ">\\n" value']
            continue
        required = schema.get("required")
        required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        seq = [head]
        for j, (name, prop) in enumerate(props.items()):
            p = f"p{i}_{j}"
            seq.append(p if name in required else f"{p}?")
            value = _xml_value(p, prop, schema, rules)
            rules.append(f'{p}: "<parameter=" {json.dumps(name)} ">\\n" {value}')
        rules.append(f"f{i}: " + " ".join(seq))
    return [*rules, _XML_VALUE]


def _xml_value(p: str, prop: Any, schema: dict[str, Any], rules: list[str]) -> str:
    """Parameter p's value and end as a Lark expression (rules: where a JSON value's rule goes)."""
    if not isinstance(prop, dict):
        return "value"
    if is_text(prop, schema):  # toolparse's view: a `$ref`, `anyOf` or enum says the types too
        target = resolve_refs(prop, schema)
        target = target if isinstance(target, dict) else {}
        texts = target["enum"] if "enum" in target else [target["const"]] if "const" in target else None
        if isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
            return "(" + " | ".join(json.dumps(t) for t in texts) + ") " + _XML_END
        return "value"
    if schema_types(prop, schema) == {"boolean"}:
        return '("true" | "false" | "True" | "False") ' + _XML_END
    if not _refs_resolve_in_definitions(prop, schema):
        return "value"  # its JSON rule could not resolve them (`#/properties/...`, `#`): text, as before
    # the tool's definitions go along, so that the value's `$ref`s resolve in its own %json rule
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    rules.append(f"{p}_json: {_json_rule({**prop, **defs})}")
    return f"{p}_json {_XML_END}"


def _refs_resolve_in_definitions(prop: dict[str, Any], schema: dict[str, Any]) -> bool:
    """Every `$ref` in a parameter's schema names the tool's `$defs` / `definitions` (which its own %json
    rule gets a copy of), and the parameter has no definitions of its own that the copy would replace."""
    if "$defs" in prop or "definitions" in prop:
        return False
    stack: list[Any] = [prop]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None and not (
                isinstance(ref, str)
                and ref.startswith(("#/$defs/", "#/definitions/"))
                and resolve_refs(node, schema) is not None
            ):
                return False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return True


def render_prompt(tokenizer: Any, req: ChatCompletionRequest) -> str:
    """The prompt text for a chat request (an assistant turn opened, or the last message continued: vLLM's
    add_generation_prompt / continue_final_message); template errors are the client's mistake (400). A
    template that refuses the request's system messages where they are (the family's official ones raise
    "System message must be at the beginning" for a second one; opencode, Claude Code's hooks and memory
    plugins send them) gets them folded as the other APIs fold them (fold_system_messages); a template
    that takes them is given them as they are."""
    if not tokenizer.has_chat_template:
        raise APIError(
            400, "this model has no chat template; use /v1/completions with a plain prompt", "messages"
        )
    messages = [template_message(i, m) for i, m in enumerate(req.messages)]
    tools = req.template_tools() or None
    kwargs = dict(req.chat_template_kwargs or {})
    if taken := sorted(
        kwargs.keys() & {"messages", "tools", "add_generation_prompt", "continue_final_message"}
    ):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
    if req.tool_choice is not None:
        choice = req.tool_choice
        named = isinstance(choice, NamedToolChoice)  # a function's form, as the template knows tools
        kwargs["tool_choice"] = {"type": "function", "function": choice.function} if named else choice

    def render(messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=req.opens_turn(),
            continue_final_message=req.continue_final_message,
            **kwargs,
        )

    try:
        return render(messages)
    except (TokenizerError, TypeError) as e:
        folded = [dict(m) for m in messages]
        fold_system_messages(folded)
        if [m["role"] for m in folded] != [m["role"] for m in messages]:
            try:
                return render(folded)
            except (TokenizerError, TypeError):
                pass
        raise APIError(400, str(e), "messages") from None


def opens_reasoning(prompt: str, continued: str | None = None) -> bool:
    """The output starts as reasoning: the template ended the prompt with `<think>`, or the message the
    output continues (continue_final_message: its text) opened `<think>` and did not close it."""
    if prompt.rstrip().endswith(THINK_OPEN):
        return True
    return continued is not None and continued.rfind(THINK_OPEN) > continued.rfind(THINK_CLOSE)


def continued_text(req: ChatCompletionRequest) -> str | None:
    """The text of the message a continue_final_message request continues (None: none)."""
    if not req.continue_final_message:
        return None
    return template_message(len(req.messages) - 1, req.messages[-1])["content"]


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A function call (`function`: name, arguments) or a custom tool's (`custom`: name, input)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    if call.custom:
        out.update({"id": call.id, "type": "custom", "custom": {"name": call.name, "input": call.arguments}})
    else:
        fn = {"name": call.name, "arguments": call.arguments}
        out.update({"id": call.id, "type": "function", "function": fn})
    return out


def piece_json(p: ToolCallPiece) -> dict[str, Any]:
    """A streamed tool-call delta: a call's first piece names it (id, type, name), later ones only add to
    its arguments, or a custom tool's input (OpenAI's streaming shape)."""
    if p.id is None:
        key, field = ("custom", "input") if p.custom else ("function", "arguments")
        return {"index": p.index, key: {field: p.arguments}}
    return tool_call_json(ToolCall(p.name or "", p.arguments, p.id, p.custom), p.index)


def delta_json(d: ParsedDelta) -> dict[str, Any]:
    """A streamed `delta` object."""
    out: dict[str, Any] = {}
    if d.reasoning:  # under vLLM's name and the older one clients still read
        out["reasoning"] = out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [piece_json(p) for p in d.tool_calls]
    return out


def message_json(d: ParsedDelta, reasoned: bool = False) -> dict[str, Any]:
    """The assistant message of a parsed output (reasoned: it had reasoning, perhaps not shown)."""
    calls = d.calls()
    # content null when the output was reasoning or calls only (vLLM's, e.g. reasoning cut by max_tokens)
    content = d.content or (None if calls or d.reasoning or reasoned else "")
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if d.reasoning:  # under vLLM's name and the older one clients still read
        msg["reasoning"] = msg["reasoning_content"] = d.reasoning
    if calls:
        msg["tool_calls"] = [tool_call_json(c) for c in calls]
    return msg


def finish_reason(engine_reason: str | None, n_tool_calls: int) -> str:
    reason = engine_reason or "length"
    return "tool_calls" if n_tool_calls and reason == "stop" else reason
