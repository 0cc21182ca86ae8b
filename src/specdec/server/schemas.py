"""Wire types of the OpenAI-compatible API (pydantic v2).

Requests carry only *types* here; value ranges (temperature >= 0, top_p in (0, 1], max_tokens
>= 1 and within the context) are checked by the engine's own frozen configs, so the server and
the library cannot disagree about what is valid. Unknown fields are ignored, as OpenAI clients
send optional extras, but features the engine cannot honour are refused rather than dropped:
every OpenAI request field is either honoured or listed in ``UNSUPPORTED`` (docs/server.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.metrics import RequestStats

# Features a client might ask for that this server cannot honour: refusing them (400) is better
# than silently answering something else. Value = the field's "not used" values.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "prompt_cache_key": (None,),
    "prompt_cache_retention": (None,),
    "safety_identifier": (None,),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always honoured:
    output is constrained to the schema whatever its value)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (one JSON object)
    or ``json_schema`` (JSON valid against ``json_schema.schema``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class GrammarSpec(BaseModel):
    """specdec extra ``grammar``: ``{"type": "regex" | "ebnf" | "json_schema", "value": ...}``
    (EBNF in Lark or llama.cpp GBNF syntax; a JSON schema as an object or its text)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["regex", "ebnf", "json_schema"]
    value: str | dict[str, Any]


class _SamplingRequest(BaseModel):
    """Fields shared by both generation endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch's seed range
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM-compatible extras (pass with the openai client's ``extra_body``)
    top_k: int = 0
    ignore_eos: bool = False
    # specdec extra: this request's time budget in seconds (queueing + decoding), at most the
    # server's --request-timeout
    timeout: float | None = Field(default=None, gt=0)
    # structured output: OpenAI's response_format, or the specdec extra grammar
    response_format: ResponseFormat | None = None
    grammar: GrammarSpec | None = None
    user: str | None = None  # an end-user identifier for the client's own records; no effect

    def unsupported_field(self) -> str | None:
        """The first field set to a feature this server does not implement, if any."""
        extra = self.model_extra or {}
        for name, unused in UNSUPPORTED.items():
            if name in extra and extra[name] not in unused:
                return name
        return None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingRequest):
    # A string, a one-element list of strings, or a list of token ids.
    prompt: str | list[str] | list[int]
    # legacy shape: the number of most likely alternatives to list per token (0: the chosen
    # token's log-prob only)
    logprobs: int | None = Field(default=None, ge=0, le=20)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer clients send this instead of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


# -- responses ------------------------------------------------------------------------------------
def _omit_none(v: object) -> bool:
    return v is None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, stats: RequestStats) -> Usage:
        return cls(
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.new_tokens,
            total_tokens=stats.prompt_tokens + stats.new_tokens,
        )


class Speculation(BaseModel):
    """The extra ``speculation`` field: how much the speculator saved on this request."""

    method: str
    mean_accepted: float = Field(description="τ: tokens committed per target forward pass")
    accepted_tokens: int
    drafted_tokens: int
    acceptance_rate: float
    target_forwards: int
    acceptance_by_position: list[float]
    decode_seconds: float

    @classmethod
    def of(cls, method: str, stats: RequestStats) -> Speculation:
        d = stats.to_dict()
        return cls(
            method=method,
            mean_accepted=d["mean_accepted"],
            accepted_tokens=d["accepted_tokens"],
            drafted_tokens=d["drafted_tokens"],
            acceptance_rate=d["acceptance_rate"],
            target_forwards=d["target_forwards"],
            acceptance_by_position=d["acceptance_by_position"],
            decode_seconds=d["seconds"],
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_omit_none)
    speculation: Speculation | None = Field(default=None, exclude_if=_omit_none)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: Speculation


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=_omit_none)
    speculation: Speculation | None = Field(default=None, exclude_if=_omit_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    context_length: int
    speculation_method: str
    speculator: str  # the full spec, options included


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
