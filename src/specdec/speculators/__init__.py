"""Speculators: each proposes a DraftTree; each registers a name, an options type and a factory.

Importing this package registers every built-in speculator (and ``auto``, the controller over
several of them, from :mod:`specdec.speculators.auto`).
"""

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
    suffix,
)
from specdec.speculators.base import DraftContext, Feedback, Speculator, build_speculator
from specdec.speculators.cross_vocab import CrossVocabSpeculator
from specdec.speculators.draft_model import DraftModelSpeculator, DraftOptions
from specdec.speculators.eagle import EagleOptions
from specdec.speculators.lookahead import LookaheadConfig
from specdec.speculators.medusa import MedusaOptions
from specdec.speculators.none import NoSpeculator
from specdec.speculators.osd import OsdOptions
from specdec.speculators.prompt_lookup import PromptLookupOptions, PromptLookupSpeculator
from specdec.speculators.self_spec import SelfOptions
from specdec.speculators.spec import (
    SpeculatorOptions,
    available,
    format_spec,
    option,
    options_for,
    parse_spec,
    register,
    registry_help,
    split_specs,
)
from specdec.speculators.suffix import SuffixCache, SuffixOptions, SuffixSpeculator

__all__ = [
    "auto",
    "CrossVocabSpeculator",
    "DraftContext",
    "DraftModelSpeculator",
    "DraftOptions",
    "EagleOptions",
    "Feedback",
    "LookaheadConfig",
    "MedusaOptions",
    "NoSpeculator",
    "OsdOptions",
    "PromptLookupOptions",
    "PromptLookupSpeculator",
    "SelfOptions",
    "Speculator",
    "SpeculatorOptions",
    "SuffixCache",
    "SuffixOptions",
    "SuffixSpeculator",
    "available",
    "build_speculator",
    "draft_model",
    "eagle",
    "format_spec",
    "lookahead",
    "medusa",
    "none",
    "option",
    "options_for",
    "osd",
    "parse_spec",
    "prompt_lookup",
    "register",
    "registry_help",
    "self_spec",
    "split_specs",
    "suffix",
]
