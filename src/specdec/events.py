"""What the decoding loop yields and what generate() returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.logprobs import TokenLogprob
from specdec.metrics import RequestStats


@dataclass(frozen=True)
class TokenEvent:
    """Tokens committed by one step, with the text they add (``text`` is a delta).

    ``finish_reason`` is set on the last event: ``"stop"`` (EOS or a stop string) or
    ``"length"`` (``max_new_tokens``). ``stats`` is a snapshot of the request's statistics
    after this step.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stats: RequestStats
    # one per token in token_ids when the request asked for logprobs (see specdec.logprobs)
    logprobs: tuple[TokenLogprob, ...] | None = None
    # the end-of-sequence token that ended the output (not in token_ids), when one did
    eos_token_id: int | None = None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    method: str
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    eos_token_id: int | None = None  # the end-of-sequence token that ended it, if one did

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "method": self.method,
            "stats": self.stats.to_dict(),
            **(
                {}
                if self.logprobs is None
                else {
                    "logprobs": [
                        {
                            "token_id": lp.token_id,
                            "logprob": lp.logprob,
                            "top": [list(t) for t in lp.top],
                        }
                        for lp in self.logprobs
                    ]
                }
            ),
        }


class ResultBuilder:
    """Collects one request's events into its :class:`GenerationResult` (``generate`` and
    the batch's ``generate_batch`` both do)."""

    def __init__(self, logprobs: bool = False) -> None:
        self.token_ids: list[int] = []
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.finish = "length"
        self.stats = RequestStats()
        self.eos: int | None = None

    def add(self, event: TokenEvent) -> None:
        self.token_ids.extend(event.token_ids)
        self.parts.append(event.text)
        if self.logprobs is not None and event.logprobs is not None:
            self.logprobs.extend(event.logprobs)
        self.stats = event.stats
        if event.finish_reason:
            self.finish = event.finish_reason
        if event.eos_token_id is not None:
            self.eos = event.eos_token_id

    def result(self, method: str) -> GenerationResult:
        text = "".join(self.parts)
        return GenerationResult(
            text, self.token_ids, self.finish, method, self.stats, self.logprobs, self.eos
        )
