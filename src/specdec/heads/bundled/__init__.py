"""Speculator heads shipped with the package, so the bundled model speculates with a trained
drafter out of the box (``--speculator eagle``: no training, no path).

Each head sits in its own directory in the format its loader reads, with ``TRAINING.md`` (data,
settings, wall time, held-out figures) beside it. A head is for one target only; asking for the
bundled head on another model is an error that says how to train one.
"""

from __future__ import annotations

import os
from pathlib import Path

from specdec.errors import CheckpointError
from specdec.heads.eagle import EagleHead
from specdec.target.loading import LoadedModel

HERE = Path(__file__).parent
EAGLE3_SMOLLM2 = HERE / "eagle3-smollm2-135m-instruct"


def eagle_head(path: str | os.PathLike[str] | None, loaded: LoadedModel) -> EagleHead:
    """The drafter in ``path``, or without one the shipped head (what ``eagle`` with no ``dir``
    means wherever an EAGLE spec is read: serving, benchmarks, export)."""
    from specdec.heads.eagle_io import load_eagle

    return load_eagle(path, loaded) if path else bundled_eagle(loaded)


def bundled_eagle(loaded: LoadedModel) -> EagleHead:
    """The shipped EAGLE-3 head for the bundled SmolLM2-135M-Instruct."""
    from specdec.heads.eagle_io import load_eagle

    if not (EAGLE3_SMOLLM2 / "config.json").is_file():
        raise CheckpointError(
            f"the shipped EAGLE-3 head is missing from the installation ({EAGLE3_SMOLLM2}); "
            "reinstall specdec, or pass a drafter directory: --speculator eagle:DIR"
        )
    try:
        return load_eagle(EAGLE3_SMOLLM2, loaded)
    except CheckpointError as e:
        raise CheckpointError(
            "the shipped EAGLE-3 head is for the bundled SmolLM2-135M-Instruct, not this target "
            f"({e}); train one for it with `specdec train eagle --out DIR` and pass "
            "--speculator eagle:DIR"
        ) from None
