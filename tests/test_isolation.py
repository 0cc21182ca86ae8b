"""No test sees the developer's cache: calibrations planted in the real user cache location are
not used, each test starts from an empty cache of its own, subprocesses inherit it, and the
converted models are the one shared store (see tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specdec import SpeculativeEngine
from specdec.control.calibration import CostCalibration, save_cost_calibration
from specdec.speculators.self_spec import save_calibration, saved_choice
from specdec.target import load_model, loading

# Distinctive T(n)/T(1), far from any generic prior: seen only if this file is read.
PLANTED = CostCalibration(chain={1: 0.1, 2: 0.37, 4: 0.73}, tree={1: 0.1, 2: 0.41, 4: 0.89})


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


def test_each_test_has_an_empty_cache_of_its_own(isolated_cache: Path, specdec_cache):
    assert loading.cache_root() == isolated_cache
    assert not isolated_cache.resolve().is_relative_to(specdec_cache.real_root.resolve())
    assert [p.name for p in isolated_cache.iterdir()] == ["gguf"]  # no calibrations
    assert (isolated_cache / "gguf").resolve() == (specdec_cache.models / "gguf").resolve()


@contextmanager
def moved_to_real_cache(path: Path, isolated_root: Path, real_root: Path) -> Iterator[Path]:
    """Move ``path`` (under the test's cache) to the same place in the real user cache, and
    remove it, and the folders made for it, afterwards."""
    target = real_root / path.relative_to(isolated_root)
    made = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    planted = False
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("x") as f:  # never overwrite a real file
                planted = True
                f.write(path.read_text())
        except FileExistsError:
            pytest.skip(f"{target} exists already (another run planting it?)")
        except OSError as e:
            pytest.skip(f"cannot write the real user cache here: {e}")
        path.unlink()
        yield target
    finally:
        if planted:
            target.unlink(missing_ok=True)
        for folder in made:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                break


def test_calibrations_in_the_real_user_cache_are_not_seen(tiny, isolated_cache, specdec_cache):
    prior = SpeculativeEngine.from_pretrained(tiny, speculator="prompt-lookup").cost_model
    assert prior.chain_ratios != PLANTED.ratios(False)
    # Positive control: at the location the library uses, these files are read.
    cost = save_cost_calibration(tiny, PLANTED)
    self_choice = save_calibration(tiny, "skip:2@0.2", {"tokens_per_second": 1.0})
    engine = SpeculativeEngine.from_pretrained(tiny, speculator="prompt-lookup")
    assert engine.cost_model.chain_ratios == PLANTED.ratios(False)
    assert saved_choice(tiny) == "skip:2@0.2"
    # The same files in the developer's cache: not seen.
    real = specdec_cache.real_root
    with (
        moved_to_real_cache(cost, isolated_cache, real) as planted_cost,
        moved_to_real_cache(self_choice, isolated_cache, real) as planted_choice,
    ):
        assert json.loads(planted_cost.read_text())["chain_ratio"]["2"] == 3.7
        assert planted_choice.is_file() and not cost.exists() and not self_choice.exists()
        engine = SpeculativeEngine.from_pretrained(tiny, speculator="prompt-lookup")
        assert engine.cost_model.chain_ratios == prior.chain_ratios
        assert saved_choice(tiny) is None


def test_the_real_user_cache_is_refused(specdec_cache, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(specdec_cache.real_root.parent))
    with pytest.raises(pytest.fail.Exception, match="real user cache"):
        loading.cache_root()


@pytest.mark.slow(threads=1)
def test_subprocesses_inherit_the_isolated_cache(isolated_cache: Path):
    code = "from specdec.target.loading import cache_root; print(cache_root())"
    assert os.environ["XDG_CACHE_HOME"] == str(isolated_cache.parent)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert Path(out.strip()) == isolated_cache


def test_session_subprocesses_get_a_session_cache(specdec_cache):
    root = specdec_cache.session_home / "specdec"
    assert not root.resolve().is_relative_to(specdec_cache.real_root.resolve())
    assert (root / "gguf").resolve() == (specdec_cache.models / "gguf").resolve()
