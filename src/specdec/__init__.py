"""specdec: lossless speculative decoding for Hugging Face causal language models."""

from specdec.config import GenerationConfig, SamplingConfig
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.events import GenerationResult, TokenEvent
from specdec.metrics import RequestStats
from specdec.speculators import Speculator, SpeculatorOptions, parse_spec, register
from specdec.target import load_model
from specdec.tree import DraftTree

__all__ = [
    "DraftTree",
    "GenerationConfig",
    "GenerationResult",
    "RequestStats",
    "SamplingConfig",
    "SpecDecError",
    "Speculator",
    "SpeculatorOptions",
    "SpeculativeEngine",
    "TokenEvent",
    "load_model",
    "parse_spec",
    "register",
]
__version__ = "0.1.0"
