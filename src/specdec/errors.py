"""One hierarchy of typed errors.

Every error a user can cause derives from :class:`SpecDecError`, so the CLI and the server can turn
any of them into a one-line message (or a 4xx response) instead of a traceback. Messages say what
to do, not only what went wrong.
"""

from __future__ import annotations


class SpecDecError(Exception):
    """Base of every error specdec raises on purpose."""


class InvalidRequestError(SpecDecError, ValueError):
    """A request parameter is out of range (empty prompt, negative temperature, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens to generate) does not fit in the model's context."""


class ConfigError(SpecDecError, ValueError):
    """An engine or speculator configuration value is invalid."""


class ModelNotFoundError(SpecDecError, FileNotFoundError):
    """A model path does not exist or is not a model; specdec never downloads from a hub."""


class CorruptModelError(SpecDecError):
    """A model file exists but cannot be read (truncated GGUF, broken safetensors, bad config)."""


class UnsupportedModelError(SpecDecError):
    """The model cannot be driven losslessly by the engine (e.g. no rollback-able KV cache)."""


class VocabularyMismatchError(SpecDecError):
    """A draft model does not share the target's vocabulary, so its tokens would mean other text."""


class UnknownSpeculatorError(ConfigError):
    """No speculator is registered under the requested name."""


class DataError(SpecDecError):
    """A training data directory or prompt file is missing, empty, malformed, or was made for
    another target model."""


class CheckpointError(SpecDecError):
    """A trained speculator checkpoint is missing, corrupt, or does not fit the target."""


class TrainingDivergedError(SpecDecError):
    """A training loss became NaN or infinite: the run cannot recover on its own."""
