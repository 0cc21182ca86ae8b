"""Acceptance rules and sampling utilities (pure functions of logits and drafts)."""

from specdec.verify.rules import (
    Acceptance,
    AcceptanceRule,
    GreedyRule,
    RejectionSamplingRule,
    rule_for,
)
from specdec.verify.sampling import make_generator, probs_from_logits, sample
from specdec.verify.typical import TypicalAcceptanceRule

__all__ = [
    "Acceptance",
    "AcceptanceRule",
    "GreedyRule",
    "RejectionSamplingRule",
    "TypicalAcceptanceRule",
    "make_generator",
    "probs_from_logits",
    "rule_for",
    "sample",
]
