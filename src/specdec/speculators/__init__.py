"""Speculators: each proposes a DraftTree; a registry maps method names to factories."""

from specdec.speculators import (
    auto,
    draft_model,
    eagle,
    lookahead,
    medusa,
    none,
    osd,
    prompt_lookup,
    self_spec,
)
from specdec.speculators.base import (
    DraftContext,
    Feedback,
    Speculator,
    available,
    build_speculator,
    register,
)
from specdec.speculators.draft_model import DraftModelSpeculator
from specdec.speculators.none import NoSpeculator
from specdec.speculators.prompt_lookup import PromptLookupSpeculator
from specdec.speculators.suffix import SuffixCache, SuffixSpeculator

__all__ = [
    "DraftContext",
    "DraftModelSpeculator",
    "Feedback",
    "NoSpeculator",
    "PromptLookupSpeculator",
    "Speculator",
    "SuffixCache",
    "SuffixSpeculator",
    "auto",
    "available",
    "build_speculator",
    "draft_model",
    "eagle",
    "lookahead",
    "medusa",
    "none",
    "osd",
    "prompt_lookup",
    "self_spec",
    "register",
]
