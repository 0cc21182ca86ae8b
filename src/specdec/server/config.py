"""Server settings, separate from the engine's: they govern admission and time, not decoding."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    """How the server admits, bounds and names requests.

    ``max_batch`` is how many requests decode together (continuous batching: one target pass
    per step verifies them all; 1 decodes one request at a time). ``max_queue`` bounds the
    requests *waiting* for a batch slot; when it is full a
    new request is refused at once with 429 and a Retry-After estimate, instead of piling up
    memory and latency. ``request_timeout`` (seconds) covers queueing plus decoding, so a client
    never waits forever behind a long request. ``default_max_tokens`` caps a chat request that
    gives no limit (OpenAI's default would run to the end of the context). ``speculator`` is the
    spec the engine was built from (``specdec serve --speculator``), reported by ``/health`` and
    ``/v1/models`` next to the speculator's name, so an operator sees its options too.
    ``prefill_chunk`` is the most prompt tokens a step carries while other requests decode
    (chunked prefill): larger admits newcomers in fewer steps (time to first token), smaller
    keeps the others' inter-token latency down. ``prefill_slowdown`` prices that chunk and the
    batch's drafts: a step may cost at most this many times a full batch's plain step, by the
    pass costs the scheduler measures (so beside a full batch of a large model a step takes 20-30
    prompt tokens, on a small model most of the chunk; at least 16 always).
    """

    model_name: str
    speculator: str | None = None
    max_queue: int = 64
    max_batch: int = 8
    request_timeout: float = 300.0
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions
    default_max_tokens: int = 512
    max_body_bytes: int = 8 * 1024 * 1024
    prefill_chunk: int = 64
    prefill_slowdown: float = 2.0

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("the served model name must not be empty")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int):
            raise ConfigError(f"max_batch must be an integer, got {self.max_batch!r}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int):
            raise ConfigError(f"prefill_chunk must be an integer, got {self.prefill_chunk!r}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1 prompt token, got {self.prefill_chunk}")
        slowdown = self.prefill_slowdown
        if isinstance(slowdown, bool) or not isinstance(slowdown, int | float) or not slowdown >= 1:
            raise ConfigError(
                f"prefill_slowdown must be >= 1 (a multiple of a step's cost), got {slowdown!r}"
            )
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.request_timeout > 0:
            raise ConfigError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.default_completion_tokens < 1 or self.default_max_tokens < 1:
            raise ConfigError("default token limits must be >= 1")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
