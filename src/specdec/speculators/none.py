"""No speculation: every step verifies the root alone, which is plain decoding."""

from __future__ import annotations

from typing import ClassVar

from specdec.speculators.base import DraftContext, Speculator
from specdec.speculators.spec import SpeculatorOptions, register
from specdec.target import LoadedModel
from specdec.tree import DraftTree


class NoSpeculator(Speculator):
    name: ClassVar[str] = "none"
    drafts: ClassVar[bool] = False

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        return DraftTree.root_only(context.tokens[-1])


@register("none")
def _build(target: LoadedModel, options: SpeculatorOptions) -> NoSpeculator:
    """plain decoding (the reference every speedup is measured against)"""
    return NoSpeculator()
