"""Errors a user can cause with ``specdec bench``; all derive from :class:`SpecDecError`, so the CLI
turns them into one line and a non-zero exit."""

from __future__ import annotations

from specdec.errors import ConfigError, SpecDecError

PLOTS_INSTALL = "pip install 'specdec[bench]'"  # the extra that brings matplotlib


class BenchError(SpecDecError):
    """Base of benchmark-specific errors."""


class DatasetError(BenchError):
    """The question file is missing, unreadable, or yields no usable question."""


class UnknownMethodError(BenchError, ConfigError):
    """A ``--methods`` entry names no engine speculator and no Hugging Face baseline."""


class UnknownCategoryError(BenchError, ConfigError):
    """A ``--categories`` entry is neither a task group nor a raw category of the data set."""


class PlotsUnavailableError(BenchError):
    """Plots were asked for, but matplotlib (the ``bench`` extra) is missing."""
