"""The model backends behind one interface (:mod:`specdec.target.backends`), and the layering
of :mod:`specdec.target` that keeps them acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specdec.errors import ConfigError
from specdec.target import HFTarget, backend_for, dtype_choices, load_model
from specdec.target.backends import KQUANT, LLAMACPP, LOWBIT, ORT, TORCH, registered_backends
from specdec.target.backends.llamacpp import parse_draft_dtype
from specdec.target.numerics import NUMERICS

TARGET = Path(__file__).resolve().parents[1] / "src" / "specdec" / "target"


def test_every_dtype_has_exactly_one_backend():
    """Every torch numerics and llama.cpp's gguf, each claimed once, in --dtype's order."""
    assert dtype_choices() == [*NUMERICS, "gguf"]
    claimed = [d for b in registered_backends() for d in b.dtypes]
    assert sorted(claimed) == sorted(dtype_choices())
    assert backend_for("float64") is TORCH and backend_for("int4") is LOWBIT
    assert backend_for("int4-ort") is ORT and backend_for("kquant") is KQUANT
    assert backend_for("gguf") is LLAMACPP


def test_an_unknown_dtype_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown dtype 'int3'; choose one of: float32, .*gguf"):
        backend_for("int3")
    with pytest.raises(ConfigError, match="unknown dtype 'int3'"):
        load_model(dtype="int3")


def test_capabilities():
    """llama.cpp is the one backend the batch scheduler, trees and feature speculators lack."""
    for backend in (TORCH, LOWBIT, ORT, KQUANT):
        assert backend.batching and backend.trees and backend.features
        assert not backend.threads and "cpu" in backend.devices
    assert TORCH.devices == ("cpu", "cuda") and LOWBIT.devices == ("cpu",)
    assert not (LLAMACPP.batching or LLAMACPP.trees or LLAMACPP.features)
    assert LLAMACPP.threads and LLAMACPP.devices == ("cpu",)
    assert TORCH.is_reference("float64") and not TORCH.is_reference("float32")
    assert not LLAMACPP.is_reference("gguf")


def test_a_loaded_model_carries_its_backend_and_verifier(tiny64):
    assert tiny64.backend is TORCH
    target = tiny64.backend.verifier(tiny64, threads=2)
    assert isinstance(target, HFTarget) and target.provides_features
    runner, verify = tiny64.backend.verification_runner(tiny64)
    assert runner.vocab_size == tiny64.config.vocab_size and callable(verify)


def test_draft_dtypes_of_llama_cpp():
    assert parse_draft_dtype("gguf") == (True, None)
    assert parse_draft_dtype("gguf-q4_0") == (True, "q4_0")
    assert parse_draft_dtype("int4") == (False, None) and parse_draft_dtype(None) == (False, None)


def _imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every import in ``path``, inside functions too."""
    module = ".".join(path.relative_to(TARGET.parents[1]).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{base}" if base else package
            found += [(base, a.name) for a in node.names]
    return found


def _target_modules() -> dict[str, Path]:
    modules = {}
    for path in TARGET.rglob("*.py"):
        name = ".".join(path.relative_to(TARGET.parents[1]).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def test_no_import_cycle_inside_target():
    """Imports inside functions count: the modules form layers, none imports one above it."""
    modules = _target_modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for base, imported in _imports(path):
            dotted = f"{base}.{imported}"
            target = dotted if dotted in modules else base
            if target in modules and target != name:
                edges[name].add(target)
    assert "specdec.target" not in set().union(
        *(edges[m] for m in modules if m != "specdec.target")
    )
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join((*path[path.index(name) :], name)))
        if name in done:
            return
        for other in sorted(edges[name]):
            visit(other, (*path, name))
        done.add(name)

    for name in sorted(modules):
        visit(name, ())


def test_no_module_imports_a_private_name_of_another():
    src = TARGET.parents[1]
    offenders = []
    for path in src.rglob("*.py"):
        for base, imported in _imports(path):
            if base.startswith("specdec") and imported.startswith("_") and imported != "*":
                offenders.append(f"{path.relative_to(src)}: {base}.{imported}")
    assert offenders == []
