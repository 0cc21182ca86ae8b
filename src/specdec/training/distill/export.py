"""The run's output: an ordinary Hugging Face model directory and its training record, each
file replaced atomically, so a reader (or a crash) never sees half of a save."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from specdec.target.loading import LoadedModel
from specdec.training.checkpoint import LoopState

TRAINING_FILE = "specdec_training.json"


def export_draft(student: PreTrainedModel, loaded: LoadedModel, out: Path) -> None:
    """Write ``student`` as a Hugging Face model directory with the target's tokenizer and
    generation config; each file is replaced atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=".export.", dir=out))
    try:
        student.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        copy.deepcopy(loaded.model.generation_config).save_pretrained(tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # temporary files are private; a model directory is not
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_training_record(out: Path, meta: dict[str, Any], state: LoopState, **extra: Any) -> None:
    """``specdec_training.json``: what the run was (``meta``), how far it got and its held-out
    figures, for a person (or a later tool) reading the directory."""
    record = {
        **meta,
        "steps": state.step,
        "tokens": state.tokens,
        "wall_seconds": round(state.wall_seconds, 2),
        "held_out": state.history,
        "held_out_agreement": state.history[-1]["agreement"] if state.history else None,
        **extra,
    }
    fd, tmp = tempfile.mkstemp(prefix=".training.", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=2))
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / TRAINING_FILE)
