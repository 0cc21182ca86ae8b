"""Taking a speculator elsewhere: ``specdec export vllm SPEC`` (see :mod:`specdec.export.vllm`)."""

from __future__ import annotations

from specdec.export.vllm import (
    LocalTarget,
    NoVllmCounterpartError,
    VllmExport,
    default_target_name,
    export_vllm,
)

__all__ = [
    "LocalTarget",
    "NoVllmCounterpartError",
    "VllmExport",
    "default_target_name",
    "export_vllm",
]
