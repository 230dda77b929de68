"""tool_choice "required" / a named function, enforced by a grammar (lumo.server.chat.forced_tool_calls):
the grammar in both tool-call forms against texts it must take and refuse, then over HTTP on the embedded
model: the reply is a call of the allowed function, its arguments the tool's schema."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

import openai

from lumo import LLM
from lumo.engine.llm import embedded_model_path
from lumo.server.chat import forced_tool_calls
from lumo.server.protocol import ChatCompletionRequest
from lumo.server.testing import TemplateForm, embedded_grammars, serve_in_thread
from lumo.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


THINK = tuple(Tokenizer.from_dir(embedded_model_path()).token_to_id(t) for t in ("<think>", "</think>"))


def _takes(form: str, req: dict, text: str | list[str], prompt: tuple[int, ...] = THINK) -> bool:
    """The forced grammar takes `text` whole (then only an end token may follow); the prompt's think tags
    say where the output starts (default: a closed block, the grammar from the first token). A list of
    texts is tokenized piece by piece (a tag spelt in ordinary tokens, not as its own token)."""
    spec = forced_tool_calls(TemplateForm(form), ChatCompletionRequest.model_validate(req))
    con = embedded_grammars().constraint(spec, prompt)
    try:
        tok = Tokenizer.from_dir(embedded_model_path())
        con.advance([i for piece in ([text] if isinstance(text, str) else text) for i in tok.encode(piece)])
    except RuntimeError:
        return False
    return con.matcher.is_accepting()


def _json(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _xml(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


@pytest.mark.parametrize("form,call", [("json", _json), ("xml", _xml)])
def test_forced_grammar_in_both_forms(form, call):
    required = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required"}
    named = {**required, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    one = {**required, "parallel_tool_calls": False}
    paris, oslo = call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Oslo", "days": 3})
    assert _takes(form, required, paris) and _takes(form, required, call("get_time", {}))
    assert _takes(form, required, paris + "\n" + oslo)  # parallel calls, one per line
    assert not _takes(form, one, paris + "\n" + oslo) and _takes(form, one, paris)
    assert _takes(form, named, call("get_time", {})) and not _takes(form, named, paris)
    assert not _takes(form, required, "Sure! " + paris)  # no text instead of or before the call
    assert not _takes(form, required, call("get_wether", {"city": "Paris"}))
    assert not _takes(form, required, call("get_weather", {"town": "Paris"}))  # a parameter not in the schema
    # the arguments follow the schema in both forms: an enum, a required parameter, an integer, the order
    assert not _takes(form, required, call("get_weather", {"city": "Rome"}))
    assert not _takes(form, required, call("get_weather", {"days": 3}))
    assert not _takes(form, required, call("get_weather", {"city": "Paris", "days": "three"}))
    assert not _takes(form, required, call("get_weather", {"days": 3, "city": "Oslo"}))
    auto = ChatCompletionRequest.model_validate({**required, "tool_choice": "auto"})
    assert forced_tool_calls(TemplateForm(form), auto) is None
    # after the reasoning: "\n\n" (Qwen's) may come first, not more; thinking only where the prompt allows it
    assert _takes(form, required, "\n\n" + paris) and not _takes(form, required, "\n\n\n" + paris)
    thought = "<think>\nthe user wants weather\n</think>\n\n" + paris
    assert _takes(form, required, thought, prompt=()) and not _takes(form, required, thought)
    assert _takes(form, required, "more thought\n</think>\n\n" + paris, prompt=THINK[:1])


@pytest.mark.parametrize("form,call", [("json", _json), ("xml", _xml)])
def test_forced_grammar_schemas(form, call):
    """A schema with $defs / $ref (pydantic writes them) resolves in its own tool; a tool without
    parameters takes any arguments (JSON) or names (XML); an empty properties object takes no parameter in
    the XML form (the JSON form keeps JSON Schema's meaning: unlisted properties allowed); XML values
    cannot hold a tag that would end them early in the parser."""
    ref = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "$defs": {"Seat": {"type": "object", "properties": {"row": {"type": "integer"}}}},
                "type": "object",
                "properties": {"seat": {"$ref": "#/$defs/Seat"}},
            },
        },
    }
    bare = {"type": "function", "function": {"name": "ping"}}
    req = {"messages": USER, "tools": [ref, bare, TIME], "tool_choice": "required"}
    assert _takes(form, req, call("book", {"seat": {"row": 3}} if form == "json" else {"seat": '{"row": 3}'}))
    assert _takes(form, req, call("ping", {"anything": 1}))
    assert _takes(form, req, call("get_time", {"zone": "UTC"})) == (form == "json")
    if form == "xml":
        for tag in ("</function>", "<parameter=x>", "</parameter>"):
            assert not _takes(form, req, call("ping", {"a": f"x\n{tag}\ny"})), tag
        assert _takes(form, req, call("ping", {"a": "x </param> <b> y"}))


def test_forced_xml_values_follow_the_schema():
    """The XML form's values are what toolparse reads for each parameter's schema: JSON where no string is
    among its types (an array whose items are a `$ref` into the tool's $defs, resolved; a boolean also as
    Jinja writes it), text where one is; each parameter at most once, the required ones present."""
    plan = {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {
                "$defs": {
                    "Stop": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    }
                },
                "type": "object",
                "properties": {
                    "stops": {"type": "array", "items": {"$ref": "#/$defs/Stop"}},
                    "fast": {"type": "boolean"},
                    "note": {"type": "string"},
                },
                "required": ["stops"],
            },
        },
    }
    req = {"messages": USER, "tools": [plan], "tool_choice": "required"}
    stops = '[{"city": "Oslo"}, {"city": "Bergen"}]'
    for fast in ("true", "False"):
        assert _takes("xml", req, _xml("plan", {"stops": stops, "fast": fast}))
    assert _takes("xml", req, _xml("plan", {"stops": "[]", "note": "any </param> text, 3 lines\n\n"}))
    for bad in (
        {"stops": "Oslo"},  # not JSON
        {"stops": '[{"town": "Oslo"}]'},  # an item without its required city
        {"stops": stops, "fast": "yes"},
        {"fast": "true"},  # stops is required
    ):
        assert not _takes("xml", req, _xml("plan", bad)), bad
    twice = _xml("plan", {"stops": "[]"}).replace(
        "</function>", "<parameter=stops>\n[]\n</parameter>\n</function>"
    )
    assert not _takes("xml", req, twice)
    # a JSON string may hold the tags (toolparse ends a typed value where it is whole); free text may not
    # hold `</tool_call>` either, which would end the call early
    tags = '[{"city": "</parameter>\\n<parameter=note>"}, {"city": "</function>"}]'
    assert _takes("xml", req, _xml("plan", {"stops": tags}))
    spelt = _xml("plan", {"stops": "[]", "note": "a </tool_call> b"}).split("</tool_call> b")
    assert not _takes("xml", req, [spelt[0] + "</tool_", "call> b" + spelt[1]])
    assert _takes("xml", req, [spelt[0] + "</tool_", "cal> b" + spelt[1]])
    # what the grammar lets through, toolparse types as the schema says
    from lumo.server.toolparse import parse_tool_call

    body = (
        _xml("plan", {"stops": stops, "fast": "False"})
        .removeprefix("<tool_call>\n")
        .removesuffix("\n</tool_call>")
    )
    call = parse_tool_call(body, {"plan": plan["function"]["parameters"]["properties"]})
    assert json.loads(call.arguments) == {"stops": [{"city": "Oslo"}, {"city": "Bergen"}], "fast": False}


def test_tool_tags_without_their_own_tokens_are_text():
    class NoTags(TemplateForm):
        def token_to_id(self, s: str) -> int | None:
            return None

    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [TIME], "tool_choice": "required"})
    spec = forced_tool_calls(NoTags("json"), req)
    assert '"<tool_call>"' in spec.grammar and "<[" not in spec.grammar


def test_chat_template_source_follows_the_tool_use_template():
    t = Tokenizer.from_dir(embedded_model_path())
    two = Tokenizer(t._tok, {"default": "plain {{ messages }}", "tool_use": "tools <function=f>"})
    assert two.chat_template_source() == "plain {{ messages }}"
    assert two.chat_template_source(tools=True) == "tools <function=f>"


@pytest.fixture(scope="module")
def served():
    llm = LLM(device="cpu")
    with serve_in_thread(llm) as url:
        yield llm, openai.OpenAI(base_url=url + "/v1", api_key="x")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice,name",
    [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")],
    ids=["required", "named"],
)
def test_forced_tool_calls_over_http(served, stream, choice, name):
    """The embedded model, which would rather write code, answers with a call of an allowed function
    whose arguments parse against the tool's schema (greedy and sampled). One call: the model never learnt
    to stop after its calls, and with parallel calls allowed it goes on calling to max_tokens."""
    _, client = served
    kw = dict(model="lumo-tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64)
    kw["parallel_tool_calls"] = False
    for temperature in (0.0, 0.9):
        if stream:
            chunks = list(client.chat.completions.create(**kw, temperature=temperature, seed=2, stream=True))
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            names = [t.function.name for t in calls if t.function.name]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert names and finish == ["tool_calls"], chunks
        else:
            r = client.chat.completions.create(**kw, temperature=temperature, seed=2)
            assert r.choices[0].finish_reason == "tool_calls", r
            calls = r.choices[0].message.tool_calls
            names = [c.function.name for c in calls]
            for c in calls:
                args = json.loads(c.function.arguments)
                if c.function.name == "get_weather":
                    assert args["city"] in ("Paris", "Oslo")
        assert set(names) <= ({name} if name else {"get_weather", "get_time"})


def test_forced_tool_calls_bad_requests(served):
    """An uncompilable tool schema, and a forced call with response_format: 400s naming tool_choice."""
    _, client = served
    bad = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/Missing"}}}
    with pytest.raises(openai.BadRequestError, match="invalid structured output") as e:
        client.chat.completions.create(model="lumo-tiny", messages=USER, tools=[bad], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model="lumo-tiny",
            messages=USER,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
        )


def test_responses_tool_choice_required(served):
    """The Responses API's tool_choice goes through the same grammar: a function_call item."""
    _, client = served
    fn = WEATHER["function"]
    r = client.responses.create(
        model="lumo-tiny",
        input="Weather in Paris?",
        tools=[{"type": "function", "name": fn["name"], "parameters": fn["parameters"]}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments)["city"] in (
        "Paris",
        "Oslo",
    )


def test_forced_xml_names_and_odd_types():
    """A name the XML form cannot carry is a 400 naming `tools`; a malformed `type` is text, not a 500."""
    from lumo.server.errors import APIError

    def tool(name: str, props: dict) -> dict:
        return {
            "type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": props}},
        }

    for name, props in (("a>b", {}), ("f", {"x>y": {}}), ("f", {" x": {}}), ("f", {"a\nb": {}})):
        req = ChatCompletionRequest.model_validate(
            {"messages": USER, "tools": [tool(name, props)], "tool_choice": "required"}
        )
        with pytest.raises(APIError) as e:
            forced_tool_calls(TemplateForm("xml"), req)
        assert e.value.status == 400 and e.value.param == "tools"
    odd = {"messages": USER, "tools": [tool("f", {"x": {"type": {"a": 1}}})], "tool_choice": "required"}
    assert _takes("xml", odd, _xml("f", {"x": "any text"}))


def test_forced_json_arguments_are_an_object():
    """A tool whose parameters schema is `{}` (no type): its forced arguments are still an object, which
    the parser takes as a call (any JSON value would not be)."""
    empty = {"type": "function", "function": {"name": "f", "parameters": {}}}
    req = {"messages": USER, "tools": [empty], "tool_choice": "required"}
    assert _takes("json", req, _json("f", {"a": 1})) and _takes("json", req, _json("f", {}))
    assert not _takes("json", req, '<tool_call>\n{"name": "f", "arguments": "function"}\n</tool_call>')


def test_forced_xml_pydantic_schemas():
    """What pydantic writes for a tool's parameters: Optional[int] (`anyOf` integer / null), a nested model
    and a string Enum (`$ref`s into `$defs`): the forced XML values follow them, and toolparse types them
    the same way (an int, an object, the enum's text)."""
    from lumo.server.toolparse import ChatOutputParser

    params = {
        "$defs": {
            "Color": {"enum": ["red", "blue"], "title": "Color", "type": "string"},
            "Size": {"properties": {"w": {"type": "integer"}}, "required": ["w"], "type": "object"},
            "Mode": {"enum": ["fast", "slow"]},  # no type: the enum's values say string
        },
        "properties": {
            "n": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
            "color": {"$ref": "#/$defs/Color"},
            "size": {"$ref": "#/$defs/Size"},
            "mode": {"$ref": "#/$defs/Mode"},
        },
        "required": ["color"],
        "type": "object",
    }
    tool = {"type": "function", "function": {"name": "paint", "parameters": params}}
    req = {"messages": USER, "tools": [tool], "tool_choice": "required"}
    good = {"n": "5", "color": "red", "size": '{"w": 3}', "mode": "slow"}
    assert _takes("xml", req, _xml("paint", good))
    assert _takes("xml", req, _xml("paint", {"n": "null", "color": "blue"}))
    for bad in ({"n": "five", "color": "red"}, {"color": "green"}, {"color": "red", "size": "big"}):
        assert not _takes("xml", req, _xml("paint", bad)), bad
    assert not _takes("xml", req, _xml("paint", {"color": "red", "mode": "medium"}))
    parser = ChatOutputParser(tools=[tool])
    delta = parser.feed(_xml("paint", good))
    delta.extend(parser.finish())
    (call,) = delta.calls()
    assert json.loads(call.arguments) == {"n": 5, "color": "red", "size": {"w": 3}, "mode": "slow"}


def test_forced_xml_refs_outside_the_definitions_are_text():
    """A typed parameter whose `$ref` its own JSON rule could not resolve (`#/properties/a`, as
    zod-to-json-schema writes a reused schema; `#`; its own `$defs`) takes free text, not a 400."""
    params = {
        "type": "object",
        "$defs": {"S": {"type": "integer"}},
        "properties": {
            "a": {"type": "integer"},
            "b": {"$ref": "#/properties/a"},
            "c": {"type": "array", "$defs": {"T": {"type": "string"}}, "items": {"$ref": "#/$defs/S"}},
        },
    }
    req = {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
    req["tool_choice"] = "required"
    assert _takes("xml", req, _xml("f", {"a": "1", "b": "two", "c": "[3]"}))
    assert not _takes("xml", req, _xml("f", {"a": "one"}))  # a plain typed parameter stays JSON
