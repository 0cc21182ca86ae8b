"""Controllers choose how much to draft per step."""

from specdec.control.budget import (
    AdaptiveBudget,
    CostModel,
    FixedBudget,
    NodeBudget,
    expected_tokens,
)

__all__ = ["AdaptiveBudget", "CostModel", "FixedBudget", "NodeBudget", "expected_tokens"]
