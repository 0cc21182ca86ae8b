"""Per-request speculation statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class RequestStats:
    """Counts and times for one request.

    ``mean_accepted`` (τ) is tokens committed per target forward pass, accepted drafts plus the
    recovered or bonus token (plain decoding: 1.0), before truncation at a stop condition;
    ``acceptance_by_position[i]`` is the fraction of steps that drafted at least i+1 tokens in
    which the (i+1)-th was accepted.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    grammar_seconds: float = 0.0  # constrained requests: pruning, masking, advancing (in verify)
    target_forwards: int = 0
    lossless: bool = True  # False when an opt-in lossy acceptance rule (typical) decided
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    choices: dict[str, int] = field(default_factory=dict)  # method auto: steps per speculator

    def record_step(self, drafted_depth: int, accepted: int) -> None:
        self.target_forwards += 1
        while len(self.drafted_at) < drafted_depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted_depth):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def record_choice(self, speculator: str) -> None:
        self.choices[speculator] = self.choices.get(speculator, 0) + 1

    @property
    def drafted_tokens(self) -> int:
        return sum(self.drafted_at)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_at)

    def snapshot(self) -> RequestStats:
        """An independent copy, safe to hand to another thread while decoding goes on."""
        return replace(
            self,
            drafted_at=list(self.drafted_at),
            accepted_at=list(self.accepted_at),
            choices=dict(self.choices),
        )

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        # accepted drafts + the one recovered/bonus token of each step
        if not self.target_forwards:
            return 0.0
        return (self.accepted_tokens + self.target_forwards) / self.target_forwards

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        pairs = zip(self.accepted_at, self.drafted_at, strict=True)
        return [a / d if d else 0.0 for a, d in pairs]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "lossless": self.lossless,
            "target_forwards": self.target_forwards,
            "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
        }
        if self.grammar_seconds:
            out["grammar_seconds"] = round(self.grammar_seconds, 4)
        if self.choices:
            out["choices"] = dict(sorted(self.choices.items()))
        return out
