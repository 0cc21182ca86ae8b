"""Target features cached on disk, keyed by the data, the target and the trainer's settings.

Extracting features costs one target pass per training sequence (docs/training.md gives the
time for the bundled model), so trainers keep them next to their checkpoint; a key mismatch
(another target, other settings) or a broken file means the cache is rebuilt, never silently
reused. ``features_per_record`` keys every answer separately, so retraining after ``specdec
data generate`` has added answers (or on a subset of the categories) extracts only the answers
the cache does not hold yet.

Why on disk and memory-mapped: EAGLE-3 features of the bundled model take about 4.7 kB per
token (three auxiliary hidden states and the final one, 576 float16 values each, plus the top-8
labels), gigabytes for the committed ShareGPT answers, and a cache read whole into memory (and
concatenated again for training) needed several times that resident (docs/training.md).
``features_per_record`` therefore keeps one append-only raw file per tensor name in a cache
directory, with an index of each answer's rows, and hands back views of private memory maps of
those files: nothing is read until a batch touches it, and :func:`release_pages` (called after
each batch) drops the pages read, so resident memory stays bounded by a batch, whatever the
size of the data.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
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
STORE_FORMAT = "specdec-features-memmap/1"
INDEX = "index.json"
_DATA_SUFFIX = ".bin"
_TMP_PREFIX = ".tmp-"


def store_dir(cache_file: str | os.PathLike[str]) -> Path:
    """The directory of the cache named ``cache_file``: that path without a ``.safetensors``
    suffix (trainers and older runs name caches ``features-train.safetensors``; the cache is now
    a directory of raw files, memory-mapped)."""
    p = Path(cache_file)
    return p.with_suffix("") if p.suffix == ".safetensors" else p


def legacy_file(cache_file: str | os.PathLike[str]) -> Path:
    """Where an earlier version kept the cache named ``cache_file`` as one safetensors file. Its
    answers are imported once, so an extraction paid before the switch (hours on a CPU) is not
    paid again."""
    root = store_dir(cache_file)
    return root.with_name(root.name + ".safetensors")


def _as_array(t: torch.Tensor, name: str) -> np.ndarray[Any, Any]:
    t = t.detach().cpu().contiguous()
    if t.ndim == 0:
        raise ValueError(f"feature {name!r} is a scalar; cache tensors need a row dimension")
    if t.dtype == torch.bfloat16:
        raise ValueError(f"feature {name!r} is bfloat16, which numpy cannot map; store float16")
    return t.numpy()


class FeatureStore:
    """One cache directory: ``NAME.bin`` per tensor name (each answer's rows appended, row-major)
    and ``index.json`` (the key, each column's dtype and row shape, every kept answer's row ends
    per column, the answers the extractor skipped).

    Appends reach the files first and become part of the cache only when :meth:`commit` has
    fsynced them and atomically replaced the index, so a run killed mid-write leaves the last
    committed cache; the next open cuts the files back to their committed length. A missing,
    stale (another key) or inconsistent index means an empty cache: its files are unlinked, not
    truncated, so memory maps still held on them (a caller's earlier views) stay valid."""

    def __init__(self, root: Path, key: str) -> None:
        self.root, self.key = root, key
        self.columns: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
        self.order: list[str] = []  # kept answers' digests, in the order their rows were written
        self.position: dict[str, int] = {}  # digest -> index in ``order``
        self.ends: dict[str, list[int]] = {}  # column -> rows written up to each kept answer
        self.skipped: set[str] = set()
        self._writers: dict[str, BinaryIO] = {}
        self._maps: dict[str, torch.Tensor] | None = None
        self._dirty = False
        self._open()

    def __contains__(self, digest: str) -> bool:
        return digest in self.position or digest in self.skipped

    def __len__(self) -> int:
        return len(self.order) + len(self.skipped)

    def _data(self, name: str) -> Path:
        return self.root / f"{name}{_DATA_SUFFIX}"

    def _row_bytes(self, name: str) -> int:
        dtype, shape = self.columns[name]
        return dtype.itemsize * int(np.prod(shape, dtype=np.int64))

    def _rows(self, name: str) -> int:
        ends = self.ends[name]
        return ends[-1] if ends else 0

    def _open(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            # a file where the directory belongs: an older single-file cache given this very
            # name is imported from the legacy path, anything else is rebuilt
            legacy = legacy_file(self.root)
            if legacy.exists():
                self.root.unlink()
            else:
                os.replace(self.root, legacy)
        try:
            index = json.loads((self.root / INDEX).read_text(encoding="utf-8"))
            if index.get("format") != STORE_FORMAT or index.get("key") != self.key:
                raise ValueError("a cache for other settings")
            self.columns = {
                str(n): (np.dtype(c["dtype"]), tuple(int(x) for x in c["shape"]))
                for n, c in index["columns"].items()
            }
            self.order = [str(d) for d in index["kept"]]
            self.ends = {n: [int(e) for e in index["ends"][n]] for n in self.columns}
            self.skipped = {str(d) for d in index["skipped"]}
            self.position = {d: i for i, d in enumerate(self.order)}
            if len(self.position) != len(self.order) or self.skipped & self.position.keys():
                raise ValueError("an answer listed twice")
            for name in self.columns:
                ends = self.ends[name]
                if len(ends) != len(self.order) or any(
                    b < a for a, b in zip([0, *ends], ends, strict=False)
                ):
                    raise ValueError(f"row ends of {name} do not match the answers")
                need = self._rows(name) * self._row_bytes(name)
                path = self._data(name)
                size = path.stat().st_size if path.exists() else 0
                if size < need:
                    raise ValueError(f"{path.name} is shorter than its index says")
                if size > need:
                    os.truncate(path, need)  # rows of an interrupted run's uncommitted answers
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self._reset()  # missing, stale or broken: start empty

    def _reset(self) -> None:
        self.columns, self.order, self.position, self.ends = {}, [], {}, {}
        self.skipped = set()
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name == INDEX or p.suffix == _DATA_SUFFIX or p.name.startswith(_TMP_PREFIX):
                    p.unlink(missing_ok=True)

    def _writer(self, name: str) -> BinaryIO:
        w = self._writers.get(name)
        if w is None:
            self.root.mkdir(parents=True, exist_ok=True)
            w = self._writers[name] = open(self._data(name), "ab")  # noqa: SIM115
        return w

    def add(self, digest: str, tensors: dict[str, torch.Tensor] | None) -> None:
        """Append one answer's tensors (``None``: the extractor skipped it); part of the cache
        from the next :meth:`commit`."""
        if digest in self:
            return
        self._dirty = True
        if tensors is None:
            self.skipped.add(digest)
            return
        arrays = {n: _as_array(t, n) for n, t in tensors.items()}
        if not self.columns:
            self.columns = {n: (a.dtype, tuple(a.shape[1:])) for n, a in sorted(arrays.items())}
            self.ends = {n: [] for n in self.columns}
        got = {n: (a.dtype, tuple(a.shape[1:])) for n, a in arrays.items()}
        if got != self.columns:
            raise ValueError(
                f"features of answer {digest} are {got}, the cache holds {self.columns}: one "
                "extractor must yield the same names, dtypes and row shapes for every answer"
            )
        try:
            for name in self.columns:
                self._writer(name).write(np.ascontiguousarray(arrays[name]).data.cast("B"))
        except BaseException:
            self._rewind()
            raise
        for name in self.columns:
            self.ends[name].append(self._rows(name) + len(arrays[name]))
        self.position[digest] = len(self.order)
        self.order.append(digest)

    def _rewind(self) -> None:
        """After a failed append: drop its partly written rows, so the files end where the
        answers already added end."""
        self.close()
        for name in self.columns:
            path = self._data(name)
            if path.exists():
                os.truncate(path, self._rows(name) * self._row_bytes(name))

    def commit(self) -> None:
        """Make every answer added so far part of the cache: data fsynced, then the index
        replaced atomically."""
        if not self._dirty:
            return
        for w in self._writers.values():
            w.flush()
            os.fsync(w.fileno())
        index = {
            "format": STORE_FORMAT,
            "key": self.key,
            "columns": {
                n: {"dtype": d.str, "shape": list(s)} for n, (d, s) in self.columns.items()
            },
            "kept": self.order,
            "ends": self.ends,
            "skipped": sorted(self.skipped),
        }
        self.root.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.root / INDEX, json.dumps(index, separators=(",", ":")).encode())
        self._dirty = False
        self._maps = None  # the files grew: map them again

    def _mapped(self) -> dict[str, torch.Tensor]:
        """Each column's committed rows as a tensor over a private (copy-on-write) memory map:
        pages are read from the file when touched, and :func:`release_pages` hands them back.
        Writable, so an in-place op on a view changes a private copy rather than crashing on a
        read-only page; nothing reaches the file."""
        self.commit()
        if self._maps is None:
            self._maps = {}
            for name, (dtype, shape) in self.columns.items():
                rows = self._rows(name)
                arr: np.ndarray[Any, Any]
                if rows == 0:  # an empty file cannot be mapped
                    arr = np.empty((0, *shape), dtype=dtype)
                else:
                    with open(self._data(name), "rb") as f:
                        mapped = mmap.mmap(
                            f.fileno(),
                            rows * self._row_bytes(name),
                            flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE,
                        )
                    _LIVE_MAPS.add(mapped)
                    arr = np.frombuffer(mapped, dtype=dtype).reshape(rows, *shape)
                self._maps[name] = torch.from_numpy(arr)
        return self._maps

    def get(self, digest: str) -> dict[str, torch.Tensor] | None:
        """One answer's tensors as views of the memory maps; None for a skipped answer."""
        i = self.position.get(digest)
        if i is None:
            if digest not in self.skipped:
                raise KeyError(digest)
            return None
        maps = self._mapped()
        out = {}
        for name, ends in self.ends.items():
            out[name] = maps[name][ends[i - 1] if i else 0 : ends[i]]
        return out

    def close(self) -> None:
        for w in self._writers.values():
            try:
                w.close()
            except OSError:
                pass
        self._writers.clear()


# every memory map a store has handed out views of, while any view lives
_LIVE_MAPS: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()


def release_pages() -> None:
    """Drop the pages of every live feature map from this process (``MADV_DONTNEED``): mapped
    pages a batch has read count as the process's resident memory until the kernel needs them
    back, so over an epoch the whole cache would show as resident. Trainers call this once a
    batch has been copied out; the data stays in the page cache while memory allows, so the
    next read of it costs a page fault, not a disk read. Views stay valid: a dropped page is
    read from the file again when touched (nothing is ever written to a map)."""
    for mapped in list(_LIVE_MAPS):
        try:
            mapped.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # closed meanwhile, or a platform without madvise
            pass


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _import_legacy(store: FeatureStore, legacy: Path) -> None:
    """Add the answers of an earlier version's single-file cache (``_save_per_record``'s
    format) under the store's key, then delete that file, whose answers now live in the store.
    One answer at a time, through safetensors' lazy slices, so the import needs no more memory
    than the largest answer. A file for other settings, or one that cannot be read, is left as
    it is."""
    if not legacy.is_file():
        return
    try:
        with safe_open(str(legacy), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != store.key or meta.get("format") != PER_RECORD_FORMAT:
                return
            kept = [str(d) for d in json.loads(meta["kept"])]
            names = sorted(k for k in f.keys() if not k.startswith("rows."))  # noqa: SIM118
            starts = {}
            for n in names:
                counts = f.get_tensor(f"rows.{n}").tolist()
                if len(counts) != len(kept):
                    return
                starts[n] = [0, *itertools.accumulate(counts)]
            slices = {n: f.get_slice(n) for n in names}
            for i, d in enumerate(kept):
                store.add(d, {n: slices[n][starts[n][i] : starts[n][i + 1]] for n in names})
            for d in json.loads(meta["skipped"]):
                store.add(str(d), None)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError):
        return  # unreadable: left alone; the answers it would have given are extracted again
    store.commit()
    legacy.unlink()


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
    taking the ones the cache ``cache_file`` (see :func:`store_dir`) already holds for the same
    target and ``salt`` and extracting only the rest. With a cache, the tensors returned are
    views of memory-mapped files, so holding them all costs no resident memory until they are
    read; without one (``None``) they are the extractor's own tensors.

    The cache keeps every answer it ever held for these settings, not only ``records``: runs on
    subsets of one data set (a learning curve, a category filter) share one extraction. A long
    extraction is saved every ``save_every`` seconds and when it stops, also by an error or an
    interrupt, so a run stopped after hours on a CPU resumes where it stopped.

    ``extract`` may return tensors of different row counts (positions, one-row counters); each
    name must keep its dtype and row shape across records."""
    if cache_file is None:
        return _extract_all(records, extract, progress, desc)
    setting = fingerprint((), identity, salt)  # the target and settings, not the records
    digests = [record_digest(r) for r in records]
    store = FeatureStore(store_dir(cache_file), setting)
    try:
        _import_legacy(store, legacy_file(cache_file))
        missing = [i for i, d in enumerate(digests) if d not in store]
        if missing:
            bar = progress(total=len(missing), desc=desc, unit="seq")
            saved = time.monotonic()
            try:
                for i in missing:
                    if digests[i] not in store:  # not the same answer listed twice
                        store.add(digests[i], extract(records[i]))
                    bar.update(1)
                    if time.monotonic() - saved > save_every:
                        store.commit()
                        saved = time.monotonic()
            finally:
                bar.close()
                store.commit()
        return [store.get(d) for d in digests]
    finally:
        store.close()


def _extract_all(
    records: Sequence[Record], extract: Extractor, progress: ProgressFactory, desc: str
) -> list[dict[str, torch.Tensor] | None]:
    bar = progress(total=len(records), desc=desc, unit="seq")
    out = []
    try:
        for r in records:
            out.append(extract(r))
            bar.update(1)
    finally:
        bar.close()
    return out
