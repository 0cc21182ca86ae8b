"""Where specdec keeps what it computes once (converted models, compiled kernels, calibrations),
and the content hash that keys it.

The lowest layer of :mod:`specdec.target`: every module that writes to the cache reads its root
here through ``files.cache_root()`` (an attribute lookup, so a test can point it elsewhere).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/specdec`` (``~/.cache/specdec`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec"


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks (GGUF files are gigabytes)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
