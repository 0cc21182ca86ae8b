"""Controllers choose how much to draft per step."""

from specdec.control.budget import FixedBudget

__all__ = ["FixedBudget"]
