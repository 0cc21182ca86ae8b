"""Frozen, validated configuration objects.

Each component receives only its own config. Validation happens in ``__post_init__`` so that a bad
value fails when the request is built, before any model work, with an error naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen from the target distribution p.

    ``temperature == 0`` means greedy decoding (argmax of the raw logits); top-k/top-p are then
    irrelevant. For ``temperature > 0`` the same temperature, top-k and top-p shape both p (target)
    and q (draft), which is what makes speculative sampling reproduce p exactly.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise InvalidRequestError("temperature must be a number", param="temperature")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}",
                param="temperature",
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise InvalidRequestError("seed must fit in 64 bits", param="seed")
        if self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be >= 0 (0 = off), got {self.top_k}", param="top_k"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request limits and stop conditions."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    @classmethod
    def of(
        cls,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | str = (),
        ignore_eos: bool = False,
    ) -> GenerationConfig:
        """From the flat keyword arguments of ``generate``/``stream``/``generate_batch``.

        >>> GenerationConfig.of(stop="END", temperature=0.5).sampling.temperature
        0.5
        """
        return cls(
            max_new_tokens=max_new_tokens,
            stop=tuple([stop] if isinstance(stop, str) else stop),
            ignore_eos=ignore_eos,
            sampling=SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
        )

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidRequestError("max_new_tokens must be an integer", param="max_new_tokens")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"max_new_tokens must be >= 1, got {self.max_new_tokens}", param="max_new_tokens"
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
