"""Every docstring example under ``src/specdec`` runs, one test per module.

Modules are found on disk, not listed here, so a new module's examples are collected without
anyone adding it. Each module is imported and its examples run with :mod:`doctest` (examples in
``functools.cached_property`` docstrings too, which :class:`doctest.DocTestFinder` skips), and
every example in the source must be one that ran: an example doctest cannot reach is a failure,
not a silent pass. A module that needs an optional extra is skipped without it, except in CI
(``CI`` set), which installs every extra (scripts/install.sh).
"""

from __future__ import annotations

import doctest
import functools
import importlib
import importlib.util
import inspect
import os
from pathlib import Path
from types import ModuleType

import pytest

PACKAGE = "specdec"


def package_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations, f"{PACKAGE} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def count_examples(text: str) -> int:
    """How many examples doctest would parse out of ``text`` (comment-only ``>>>`` lines are
    not examples).

    >>> count_examples('def f():\\n    \\"\\"\\"\\n    >>> 1 + 1\\n    2\\n    \\"\\"\\"\\n')
    1
    >>> count_examples('x = 1  # no examples here')
    0
    """
    return len(doctest.DocTestParser().get_examples(text))


def modules_with_examples() -> dict[str, int]:
    """Dotted module name -> number of examples in its source, for every module that has any."""
    root = package_dir()
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        n = count_examples(path.read_text(encoding="utf-8"))
        if n:
            parts = path.relative_to(root.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = n
    return found


MODULES = modules_with_examples()


def import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing in ("", PACKAGE) or os.environ.get("CI"):
            raise
        pytest.skip(f"{name} needs {missing!r}, an optional extra (scripts/install.sh)")


def find_tests(module: ModuleType) -> list[doctest.DocTest]:
    tests = doctest.DocTestFinder().find(module)
    parser = doctest.DocTestParser()
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        for attr, value in vars(cls).items():
            if isinstance(value, functools.cached_property) and value.__doc__:
                tests.append(
                    parser.get_doctest(
                        value.__doc__,
                        dict(vars(module)),
                        f"{module.__name__}.{cls.__qualname__}.{attr}",
                        module.__file__,
                        value.func.__code__.co_firstlineno + 1,
                    )
                )
    return sorted((t for t in tests if t.examples), key=lambda t: t.name)


def test_modules_are_discovered():
    assert "specdec.tree.topology" in MODULES and "specdec.verify.sampling" in MODULES
    assert all(name.startswith(f"{PACKAGE}.") for name in MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_docstring_examples(name: str):
    module = import_module(name)
    tests = find_tests(module)
    found = sum(len(t.examples) for t in tests)
    assert found == MODULES[name], (
        f"{name}: {MODULES[name]} examples in the source, but doctest reaches {found}; "
        "the others never run"
    )
    runner = doctest.DocTestRunner(optionflags=0)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
