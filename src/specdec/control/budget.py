"""Draft budget policies. The adaptive, cost-model-driven controller builds on this seam."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedBudget:
    """Draft K tokens per step, never past the request's remaining tokens or the context."""

    num_draft_tokens: int

    def choose(self, remaining_tokens: int, context_room: int) -> int:
        """
        >>> FixedBudget(5).choose(remaining_tokens=3, context_room=100)
        2
        """
        return max(0, min(self.num_draft_tokens, remaining_tokens - 1, context_room - 1))
