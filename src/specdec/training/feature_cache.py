"""Target features cached on disk, keyed by the data, the target and the trainer's settings.

Extracting features costs one target pass per training sequence (minutes on a CPU), so
trainers keep them next to their checkpoint; a key mismatch (other data, another target,
other settings) or a broken file means the cache is rebuilt, never silently reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specdec.training.data import Record


def fingerprint(records: Sequence[Record], identity: dict[str, Any], salt: str) -> str:
    """Digest of the target's identity, the trainer's ``salt`` and every record's tokens."""
    h = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    h.update(salt.encode())
    for r in records:
        h.update(f"{r.index}:{r.prompt_len}:{len(r.tokens)};".encode())
        h.update(torch.tensor(r.tokens, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:32]


def load_cached(
    cache_file: Path | None, key: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The tensors and metadata stored under ``key``, or None (missing, stale or broken)."""
    if cache_file is None or not cache_file.is_file():
        return None
    try:
        with safe_open(str(cache_file), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") != key:
            return None
        return load_file(str(cache_file)), meta
    except (SafetensorError, OSError, ValueError, KeyError):
        return None  # a broken cache is rebuilt


def save_cached(
    cache_file: Path | None,
    key: str,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write atomically (temp file + rename), so an interrupted run leaves no half file."""
    if cache_file is None:
        return
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(".tmp")
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(tmp), metadata={**(metadata or {}), "key": key})
    os.replace(tmp, cache_file)
