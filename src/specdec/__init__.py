"""specdec: lossless speculative decoding for Hugging Face causal language models."""

from specdec.config import GenerationConfig, SamplingConfig, SpeculationConfig
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.events import GenerationResult, TokenEvent
from specdec.metrics import RequestStats
from specdec.target import load_model
from specdec.tree import DraftTree

__all__ = [
    "DraftTree",
    "GenerationConfig",
    "GenerationResult",
    "RequestStats",
    "SamplingConfig",
    "SpecDecError",
    "SpeculationConfig",
    "SpeculativeEngine",
    "TokenEvent",
    "load_model",
]
__version__ = "0.1.0"
