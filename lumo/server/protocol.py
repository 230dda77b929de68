"""OpenAI request bodies (pydantic) and the checks for values lumo does not support.

Unknown fields are ignored, like the OpenAI API's harmless extras (user, store, metadata, service_tier...).
Fields lumo knows but cannot honour are accepted at their neutral value (best_of 1, response_format text,
...) and rejected with a 400 that names the field otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from ..engine.grammar import StructuredOutputs
from ..engine.llm import FLOAT32_MAX
from ..engine.logprobs import MAX_LOGPROBS
from .errors import APIError
from .toolparse import CUSTOM_PARAMETER


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: StrictBool = False


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class CustomCall(BaseModel):
    name: str
    input: str


class ToolCallIn(BaseModel):
    """A call in an assistant message: of a function, or of a custom tool (its input text), which the
    template is shown as a call of the function the custom tool is shown as (custom_function)."""

    id: str | None = None
    type: Literal["function", "custom"] = "function"
    function: FunctionCall | None = None
    custom: CustomCall | None = None

    @model_validator(mode="after")
    def _as_function(self) -> ToolCallIn:
        if self.type == "custom":
            if self.custom is None:
                raise ValueError("a custom tool call needs `custom` (name, input)")
            self.function = FunctionCall(
                name=self.custom.name, arguments={CUSTOM_PARAMETER: self.custom.input}
            )
        elif self.function is None:
            raise ValueError("a function tool call needs `function` (name, arguments)")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class CustomGrammar(BaseModel):
    definition: str = Field(min_length=1)
    syntax: Literal["lark", "regex"]


class CustomFormat(BaseModel):
    """A custom tool's input: any text, or text a grammar (Lark, or a regular expression) matches."""

    type: Literal["text", "grammar"] = "text"
    grammar: CustomGrammar | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> CustomFormat:
        if (self.type == "grammar") != (self.grammar is not None):
            raise ValueError("a grammar format needs `grammar` (definition, syntax), a text format none")
        return self


class CustomTool(BaseModel):
    name: str
    description: str | None = None
    format: CustomFormat = Field(default_factory=CustomFormat)


class ToolDef(BaseModel):
    """A function tool, or a custom (free-form) tool, which the model is shown as a function of one string
    parameter (custom_function) and whose calls carry that text."""

    type: Literal["function", "custom"] = "function"
    function: FunctionDef | None = None
    custom: CustomTool | None = None

    @model_validator(mode="after")
    def _as_function(self) -> ToolDef:
        if self.type == "custom":
            if self.custom is None:
                raise ValueError("a custom tool needs `custom` (name, description, format)")
            self.function = custom_function(self.custom)
        elif self.function is None:
            raise ValueError("a function tool needs `function` (name, description, parameters)")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The tool as the chat template and the output parser see it: a function."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


def custom_function(tool: CustomTool) -> FunctionDef:
    """A custom tool as the model is shown it: a function whose one string parameter holds the input text
    (described with the tool's grammar, if it has one)."""
    about = "The tool's input as plain text, written as it is (not JSON)"
    grammar = tool.format.grammar
    if grammar is not None:
        kind = "Lark grammar" if grammar.syntax == "lark" else "regular expression"
        about += f", matching this {kind}:\n{grammar.definition}"
    param = {"type": "string", "description": about}
    schema = {"type": "object", "properties": {CUSTOM_PARAMETER: param}, "required": [CUSTOM_PARAMETER]}
    return FunctionDef(name=tool.name, description=tool.description, parameters=schema)


class NamedToolChoice(BaseModel):
    """A function the output must call (`{"type": "function", "function": {"name": ...}}`), or a custom
    tool (`{"type": "custom", "custom": {"name": ...}}`, held as its name in `function` too)."""

    type: Literal["function", "custom"] = "function"
    function: dict[str, Any] | None = None
    custom: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _named(self) -> NamedToolChoice:
        given = self.custom if self.type == "custom" else self.function
        if not isinstance(given, dict) or not isinstance(given.get("name"), str):
            raise ValueError(f'a {self.type} tool_choice needs `{self.type}`: {{"name": ...}}')
        self.function = {"name": given["name"]}
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, under its older name
    reasoning: str | None = None  # vLLM's name for it since late 2025 (either reaches the template)


# vLLM's request options lumo does not implement -> what they ask for
_REFUSED = {"use_beam_search": "beam search"}
MAX_CHOICES = 256  # choices in one request: n (x the prompts of a completions batch)
# vLLM's older structured-output fields -> StructuredOutputs' names
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's structured_outputs options lumo has no equivalent of (a 400 rather than silently ignored)
_UNSUPPORTED_OPTIONS = ("structural_tag", "whitespace_pattern", "disable_additional_properties")


def from_response_format(rf: dict[str, Any]) -> StructuredOutputs | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return StructuredOutputs(json=spec["schema"])
    raise ValueError(f"response_format type {kind!r} is not supported (text, json_object or json_schema)")


def vllm_structured_outputs(so: dict[str, Any]) -> StructuredOutputs:
    """vLLM's structured_outputs: one of json, regex, choice, grammar, json_object, with its options
    disable_any_whitespace (lumo's default is no free whitespace in JSON) and disable_fallback (lumo has
    one grammar backend: nothing to fall back from)."""
    bad = [k for k in _UNSUPPORTED_OPTIONS if so.get(k) not in (None, False)]
    if bad:
        raise ValueError(f"structured_outputs.{bad[0]} is not supported")
    forms = {
        k: v
        for k, v in so.items()
        if k not in (*_UNSUPPORTED_OPTIONS, "disable_any_whitespace", "disable_fallback")
    }
    if so.get("disable_any_whitespace") is False:
        forms["any_whitespace"] = True
    return StructuredOutputs.of(forms)


class _Common(BaseModel):
    """Sampling and streaming fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # no cap at 2 (OpenAI's API has one, vLLM's none): at most what the samplers' f32 division takes
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=FLOAT32_MAX, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # lumo/vLLM extension; 0 or -1 = off
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as vLLM's
    stop: str | list[str] | None = None
    n: StrictInt | None = Field(default=1, ge=1, le=MAX_CHOICES)  # choices, generated one after the other
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # Penalties and min-p (OpenAI's two, vLLM's repetition_penalty and min_p; lumo.engine.sampling)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=10.0)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    # token id (a string, as JSON keys are) -> bias added to its logit; values clamped to [-100, 100]
    logit_bias: dict[str, StrictFloat] | None = None
    # vLLM's output options: end-of-sequence tokens generated like others (benchmark clients), tokens that
    # end a choice like one, the stop string kept in the text, special tokens' text shown
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = Field(default=None, ge=0)  # before them no end token or stop_token_ids
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    user: str | None = None
    # vLLM's options that lumo does not implement: a 400 when set to change the output (_REFUSED)
    use_beam_search: Any = None
    best_of: StrictInt | None = None
    # vLLM's: the prompt tokens' logprobs and k alternatives each (non-streamed; 0 with stream is ignored,
    # as vLLM does); only the prompt's last k tokens kept (truncation_side "right": its first k; -1: the
    # most that leave room for max_tokens); tokens in logprobs named `token_id:N` (None: the server's
    # --return-tokens-as-token-ids); the prompt's and the output's token ids in the response
    prompt_logprobs: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    return_token_ids: StrictBool | None = None
    # Structured outputs (lumo.engine.grammar): OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """A 400 for values lumo cannot honour (the endpoints' own fields; min_tokens against the tokens a
        request may generate is the app's check, which knows the prompt's length)."""
        self.structured()
        for name, what in _REFUSED.items():
            value = getattr(self, name)
            if value is not None and value is not False:  # 0 asks for something too (0 == False)
                raise APIError(400, f"{name} is not supported ({what})", name)
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of} is not supported (only 1)", "best_of")
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            msg = f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {k}"
            raise APIError(400, msg, "prompt_logprobs")
        if k and self.stream:
            raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
        t = self.truncate_prompt_tokens
        if t is not None and t < 1 and t != -1:
            msg = f"truncate_prompt_tokens must be -1 or a positive number of tokens, got {t}"
            raise APIError(400, msg, "truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be given with stream: true", "stream_options")

    def _structured_fields(self) -> list[str]:
        """The fields that ask for a structured output (response_format text asks for nothing)."""
        names = ("response_format", "structured_outputs", *GUIDED)
        given = [name for name in names if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None and rf.get("type", "text") == "text":
            given.remove("response_format")
        return given

    @property
    def structured_field(self) -> str | None:
        """The field that asks for a structured output (None: none does)."""
        return next(iter(self._structured_fields()), None)

    def structured(self) -> StructuredOutputs | None:
        """What the output must match (None: free text); a 400 naming the field for a malformed or
        conflicting one. Whether the grammar itself compiles is the app's check (it needs the tokenizer)."""
        given = self._structured_fields()
        if len(given) > 1:
            raise APIError(400, f"give at most one of {' and '.join(given)}", given[1])
        if not given:
            return None
        field = given[0]
        try:
            if field == "response_format":
                return from_response_format(self.response_format)
            if field == "structured_outputs":
                return vllm_structured_outputs(self.structured_outputs)
            return StructuredOutputs(**{GUIDED[field]: getattr(self, field)})
        except ValueError as e:
            raise APIError(400, str(e), field) from None

    def token_settings(self, vocab_size: Callable[[], int]) -> dict[str, Any]:
        """The settings that name token ids, checked against the vocabulary (a 400 naming the field):
        LLM.generate_stream's logit_bias and stop_token_ids (none: {}; vocab_size asked only then)."""
        if not self.logit_bias and not self.stop_token_ids:
            return {}
        vocab_size = vocab_size()
        bad = [t for t in self.stop_token_ids or () if not 0 <= t < vocab_size]
        if bad:
            msg = f"stop_token_ids {bad} lie outside the vocabulary [0, {vocab_size})"
            raise APIError(400, msg, "stop_token_ids")
        return {"logit_bias": self.logit_bias_ids(vocab_size), "stop_token_ids": self.stop_token_ids}

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with integer token ids below vocab_size (else a 400) and values clamped to [-100, 100]
        (OpenAI's range; vLLM clamps the same way)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                i = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= i < vocab_size:
                msg = f"logit_bias token id {i} is outside the vocabulary [0, {vocab_size})"
                raise APIError(400, msg, "logit_bias")
            if not math.isfinite(value):
                raise APIError(400, f"logit_bias[{key!r}] must be a finite number", "logit_bias")
            out[i] = min(100.0, max(-100.0, value))
        return out

    def stop_list(self) -> list[str] | None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s] or None

    def logprobs_k(self) -> int | None:
        """Alternatives per token for lumo.engine.logprobs (None: no logprobs)."""
        return None

    def prompt_logprobs_k(self, choice: int = 0) -> int | None:
        """The alternatives per prompt token the engine scores for choice `choice` of n (None: it scores
        none): what prompt_logprobs asks, on the first choice only (the prompt is the same for all; its
        scoring prefill reuses no cached prefix). A stream leaves it out (a 0 is all it may ask)."""
        return self.prompt_logprobs if choice == 0 and not self.stream else None

    def truncated(
        self, ids: list[int], max_tokens: int | None, limit: int, name: str = "max_tokens"
    ) -> list[int]:
        """The prompt's ids as truncate_prompt_tokens keeps them (unchanged when unset), for a context of
        `limit` tokens and `max_tokens` to generate (None: none asked; `name`: the field that asked). As
        vLLM: a k above the context is a 400, and the kept prompt is then checked as any other (the
        caller's _budget). -1 keeps the most that leave room for max_tokens (vLLM keeps the context's
        length, which no max_tokens then fits)."""
        t, field = self.truncate_prompt_tokens, "truncate_prompt_tokens"
        if t is None:
            return ids
        if t == -1:
            if max_tokens is None:
                raise APIError(400, f"{field} -1 needs {name}: the room to leave for the output", field)
            if max_tokens >= limit:
                msg = f"{name} {max_tokens} leaves no room for a prompt in the context of {limit} tokens"
                raise APIError(400, msg, name, "context_length_exceeded")
            t = limit - max_tokens
        elif t > limit:
            msg = f"{field} {t} exceeds this model's context of {limit} tokens"
            raise APIError(400, msg, field, "context_length_exceeded")
        return ids[:t] if self.truncation_side == "right" else ids[-t:]

    @property
    def choices(self) -> int:
        return self.n or 1

    def sampling(self, choice: int = 0) -> dict[str, Any]:
        """LLM.generate_stream's keyword arguments for choice `choice` of n: with a seed, choice j samples
        with seed + j, wrapped into int64 (choice 0 is the request with n = 1); without one, each choice its
        own draw."""
        # top_k 0 / -1 both mean "off" to OpenAI-style clients; lumo's engine spells it 0
        top_k = None if self.top_k is None else max(self.top_k, 0)
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": top_k,
            "seed": None if self.seed is None else (self.seed + choice + 2**63) % 2**64 - 2**63,  # int64
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "stop": self.stop_list(),
            "ignore_eos": bool(self.ignore_eos),
            "min_tokens": self.min_tokens or 0,
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "skip_special_tokens": self.skip_special_tokens is not False,
            "logprobs": self.logprobs_k(),
            "prompt_logprobs": self.prompt_logprobs_k(choice),
        }


MAX_PROMPTS = 256  # prompts in one /v1/completions request (a batch runs one prompt at a time)


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0: only with echo (the prompt scored)
    echo: StrictBool | None = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo and (self.prompt_logprobs is None or self.stream):
            msg = "max_tokens=0 needs echo=true or prompt_logprobs (the prompt scored, nothing generated)"
            raise APIError(400, msg, "max_tokens")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        return None if v is False else v  # chat's "off", sent here by some clients; true stays an error

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def shown_prompt_logprobs(self) -> int | None:
        """The alternatives of the choices' `prompt_logprobs` (None: null): prompt_logprobs', or echo with
        logprobs' (vLLM fills it then too)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def sampling(self, choice: int = 0) -> dict[str, Any]:
        # echo with logprobs: the prompt's tokens are scored too (lumo.engine.logprobs.PromptLogprobs), for
        # every choice (each echoes them); prompt_logprobs: choice 0's, with as many alternatives as either
        echoed = self.logprobs if self.echo else None
        ks = [k for k in (echoed, self.prompt_logprobs_k(choice)) if k is not None]
        return {**super().sampling(choice), "prompt_logprobs": max(ks, default=None)}

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or list of token ids, or a batch of either (served one after
        the other, choices i * n .. i * n + n - 1 for prompt i)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"got {len(batch)} prompts; a request holds at most {MAX_PROMPTS}", "prompt")
        if len(batch) * self.choices > MAX_CHOICES:
            msg = f"{len(batch)} prompts x n={self.choices} choices exceed {MAX_CHOICES} choices per request"
            raise APIError(400, msg, "n")
        for i, q in enumerate(batch):
            if len(q) == 0:
                raise APIError(400, "the prompt is empty", "prompt" if len(batch) == 1 else f"prompt[{i}]")
        return batch


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # false: one call, where tool_choice forces calls ("auto": the model decides how many)
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": false}
    # vLLM's: no assistant turn opened (None: unless continue_final_message), or the last message continued
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool = False
    include_reasoning: StrictBool | None = None  # vLLM's: false leaves the reasoning out
    # OpenAI's legacy function calling, superseded by tools / tool_choice: a 400 rather than ignored
    functions: Any = None
    function_call: Any = None
    echo: Any = None  # vLLM's chat echo (the last message prepended to the reply): a 400 rather than ignored

    def opens_turn(self) -> bool:
        """The prompt ends with the template's opening of an assistant turn."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message and self.add_generation_prompt:
            msg = "continue_final_message and add_generation_prompt cannot both be true"
            raise APIError(400, msg, "continue_final_message")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported: use tools and tool_choice", name)
        if self.echo not in (None, False):
            raise APIError(400, "echo is not supported on chat completions", "echo")
        kinds: dict[str, str] = {}  # tool name -> type
        for i, t in enumerate(self.tools or []):
            if t.function.name in kinds and "custom" in (t.type, kinds[t.function.name]):
                msg = f"tool name {t.function.name!r} is used twice (a custom tool's name must be its own)"
                raise APIError(400, msg, f"tools[{i}]")
            kinds[t.function.name] = t.type
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) or choice == "required":
            if not kinds:
                raise APIError(400, "tool_choice needs a non-empty tools list", "tool_choice")
            if isinstance(choice, NamedToolChoice) and kinds.get(choice.function["name"]) != choice.type:
                name = choice.function["name"]
                what = "unknown tool" if name not in kinds else f"a {kinds[name]} tool as {choice.type}"
                raise APIError(400, f"tool_choice names {what} {name!r}", "tool_choice")

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def custom_tools(self) -> list[str]:
        """The names of the custom tools (their calls carry input text: toolparse)."""
        return [t.function.name for t in self.tools or [] if t.type == "custom"]

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the template and the output parser see them (functions)."""
        return [t.template_dict() for t in self.tools or []]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (encoded as /v1/completions encodes it) or chat messages (rendered as
    /v1/chat/completions renders them), never both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool | None = None  # accepted: lumo encodes exactly as it does to generate
    return_token_strs: StrictBool = False

    def chat(self) -> ChatCompletionRequest | None:
        """The messages as a chat request (None for a prompt); a 400 unless exactly one of the two."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt" if self.prompt else "messages")
        if self.messages is None:
            return None
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        req = ChatCompletionRequest(
            messages=self.messages,
            tools=self.tools,
            chat_template_kwargs=self.chat_template_kwargs,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )
        req.check_supported()
        return req


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text (special tokens included)."""

    model: str | None = None
    tokens: list[StrictInt]
