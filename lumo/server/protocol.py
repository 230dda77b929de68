"""OpenAI request bodies (pydantic) and the checks for values lumo does not support.

Unknown fields are ignored, like the OpenAI API's harmless extras (user, store, metadata, service_tier...).
Fields lumo knows but cannot honour are accepted at their neutral value (logit_bias null or {}, best_of 1,
...) and rejected with a 400 that names the field otherwise.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from ..engine.logprobs import MAX_LOGPROBS
from .errors import APIError


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


MAX_CHOICES = 256  # choices in one request: n (x the prompts of a completions batch)


class _Common(BaseModel):
    """Sampling and streaming fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # lumo/vLLM extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_CHOICES)  # choices, generated one after the other
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Penalties and min-p (OpenAI's two, vLLM's repetition_penalty and min_p; lumo.engine.sampling)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported (send null or {})", "logit_bias")

    def stop_list(self) -> list[str] | None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s] or None

    def logprobs_k(self) -> int | None:
        """Alternatives per token for lumo.engine.logprobs (None: no logprobs)."""
        return None

    @property
    def choices(self) -> int:
        return self.n or 1

    def sampling(self, choice: int = 0) -> dict[str, Any]:
        """LLM.generate_stream's keyword arguments for choice `choice` of n: with a seed, choice j samples
        with seed + j (choice 0 is the request with n = 1); without one, each choice its own draw."""
        # top_k 0 / -1 both mean "off" to OpenAI-style clients; lumo's engine spells it 0
        top_k = None if self.top_k is None else max(self.top_k, 0)
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": top_k,
            "seed": None if self.seed is None else self.seed + choice,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "stop": self.stop_list(),
            "logprobs": self.logprobs_k(),
        }


MAX_PROMPTS = 256  # prompts in one /v1/completions request (a batch runs one prompt at a time)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo (the prompt scored)
    echo: bool | None = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            msg = "max_tokens=0 needs echo=true (the prompt scored, nothing generated)"
            raise APIError(400, msg, "max_tokens")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of} is not supported (only 1)", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        return None if v is False else v  # chat's "off", sent here by some clients; true stays an error

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def sampling(self, choice: int = 0) -> dict[str, Any]:
        # echo with logprobs: the prompt's tokens are scored too (lumo.engine.logprobs.PromptLogprobs)
        return {**super().sampling(choice), "prompt_logprobs": self.logprobs if self.echo else None}

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
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many calls it makes
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": false}

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            kind = self.response_format.get("type")
            raise APIError(400, f"response_format {kind!r} is not supported (only 'text')", "response_format")
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) or choice == "required":
            names = {t.function.name for t in self.tools or []}
            if not names:
                raise APIError(400, "tool_choice needs a non-empty tools list", "tool_choice")
            if isinstance(choice, NamedToolChoice) and choice.function.get("name") not in names:
                raise APIError(
                    400, f"tool_choice names unknown tool {choice.function.get('name')!r}", "tool_choice"
                )

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"
