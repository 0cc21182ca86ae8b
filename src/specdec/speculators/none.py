"""No speculation: every step verifies the root alone, which is plain decoding."""

from __future__ import annotations

from typing import ClassVar

from specdec.config import SpeculationConfig
from specdec.speculators.base import DraftContext, Feedback, register
from specdec.target import LoadedModel
from specdec.tree import DraftTree


class NoSpeculator:
    name: ClassVar[str] = "none"
    produces_q: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False
    drafts_trees: ClassVar[bool] = False

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        return DraftTree.root_only(context.tokens[-1])

    def observe(self, feedback: Feedback) -> None:
        pass

    def reset(self) -> None:
        pass


@register("none")
def _build(target: LoadedModel, config: SpeculationConfig) -> NoSpeculator:
    return NoSpeculator()
