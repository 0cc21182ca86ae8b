"""Target features cached on disk, keyed by the data, the target and the trainer's settings.

Extracting features costs one target pass per training sequence (about a second each for the
bundled model on one core), so trainers keep them next to their checkpoint; a key mismatch
(another target, other settings) or a broken file means the cache is rebuilt, never silently
reused. ``features_per_record`` keys every answer separately, so retraining after ``specdec
data generate`` has added answers (or on a subset of the categories) extracts only the answers
the cache does not hold yet.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specdec.training.data import Record
from specdec.training.progress import NullBar, ProgressFactory

PER_RECORD_FORMAT = "specdec-features-per-record/1"
Extractor = Callable[[Record], dict[str, torch.Tensor] | None]


def fingerprint(records: Sequence[Record], identity: dict[str, Any], salt: str) -> str:
    """Digest of the target's identity, the trainer's ``salt`` and every record's tokens."""
    h = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    h.update(salt.encode())
    for r in records:
        h.update(record_digest(r).encode())
    return h.hexdigest()[:32]


def record_digest(r: Record) -> str:
    h = hashlib.sha256(f"{r.index}:{r.prompt_len}:{len(r.tokens)};".encode())
    h.update(torch.tensor(r.tokens, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:24]


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


SAVE_EVERY_SECONDS = 600.0  # a long extraction's progress is saved this often


def features_per_record(
    cache_file: Path | None,
    records: Sequence[Record],
    identity: dict[str, Any],
    salt: str,
    extract: Extractor,
    progress: ProgressFactory = NullBar,
    desc: str = "target features",
    save_every: float = SAVE_EVERY_SECONDS,
) -> list[dict[str, torch.Tensor] | None]:
    """Each record's feature tensors (``extract(record)``; None for a record it skips),
    taking the ones ``cache_file`` already holds for the same target and ``salt`` and
    extracting only the rest.

    The file keeps every answer it ever held for these settings, not only ``records``: runs on
    subsets of one data set (a learning curve, a category filter) share one extraction. A long
    extraction is saved every ``save_every`` seconds, so an interrupted run (hours for a large
    set on a CPU) resumes where it stopped.

    Every tensor a record yields is stored row-concatenated with its per-record row count, so
    ``extract`` may return tensors of different lengths (positions, one-row counters)."""
    setting = fingerprint((), identity, salt)  # the target and settings, not the records
    digests = [record_digest(r) for r in records]
    have = _load_per_record(cache_file, setting)
    missing = [i for i, d in enumerate(digests) if d not in have]
    out: list[dict[str, torch.Tensor] | None] = [have.get(d) for d in digests]
    if missing:
        bar = progress(total=len(missing), desc=desc, unit="seq")
        saved = time.monotonic()
        try:
            for i in missing:
                out[i] = have[digests[i]] = extract(records[i])
                bar.update(1)
                if time.monotonic() - saved > save_every:
                    _save_per_record(cache_file, setting, have)
                    saved = time.monotonic()
        finally:
            bar.close()
        _save_per_record(cache_file, setting, have)
    return out


def _save_per_record(
    cache_file: Path | None, setting: str, have: dict[str, dict[str, torch.Tensor] | None]
) -> None:
    if cache_file is None:
        return
    kept = [(d, r) for d, r in have.items() if r is not None]
    names = sorted(kept[0][1]) if kept else []
    tensors = {}
    for name in names:
        tensors[name] = torch.cat([r[name] for _, r in kept])
        tensors[f"rows.{name}"] = torch.tensor([len(r[name]) for _, r in kept], dtype=torch.long)
    skipped = sorted(d for d, r in have.items() if r is None)
    meta = {
        "format": PER_RECORD_FORMAT,
        "kept": json.dumps([d for d, _ in kept]),
        "skipped": json.dumps(skipped),
    }
    save_cached(cache_file, setting, tensors, meta)


def _load_per_record(
    cache_file: Path | None, setting: str
) -> dict[str, dict[str, torch.Tensor] | None]:
    """digest -> that record's tensors (None: extraction skipped it); {} when unusable."""
    cached = load_cached(cache_file, setting)
    if cached is None or cached[1].get("format") != PER_RECORD_FORMAT:
        return {}
    tensors, meta = cached
    try:
        kept = json.loads(meta["kept"])
        have: dict[str, dict[str, torch.Tensor] | None] = dict.fromkeys(json.loads(meta["skipped"]))
        names = [k for k in tensors if not k.startswith("rows.")]
        split = {n: torch.split(tensors[n], tensors[f"rows.{n}"].tolist()) for n in names}
        if any(len(parts) != len(kept) for parts in split.values()):
            return {}
        for i, d in enumerate(kept):
            have[d] = {n: split[n][i] for n in names}
    except (KeyError, ValueError, RuntimeError):
        return {}  # a broken cache is rebuilt
    return have
