"""Wire types of the OpenAI-compatible API (pydantic v2).

Requests carry only *types* here; value ranges (temperature >= 0, top_p in (0, 1], max_tokens
>= 1 and within the context) are checked by the engine's own frozen configs, so the server and
the library cannot disagree about what is valid. Unknown fields are ignored, as OpenAI clients
send optional extras, but features the engine cannot honour are refused rather than dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.metrics import RequestStats

# Features a client might ask for that this server cannot honour: refusing them (400) is better
# than silently answering something else. Value = the field's "not used" values.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "functions": (None, []),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
    logprobs: None = None
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
    logprobs: None = None
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
