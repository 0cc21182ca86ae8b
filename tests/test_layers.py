"""The package's layer order, kept by a test: no import cycle between modules, no import against
the layer order, no import of another module's private names.

Imports made inside functions count as much as those at the top of a module: deferring an
import hides a cycle from the interpreter, not from a reader. Imports under
``if TYPE_CHECKING:`` do not count (they never run); an upward one is still worth avoiding.

Layers, lowest first: a module may import from its own layer and the layers below it.
``docs/architecture.md`` explains each. ``python tests/test_layers.py`` prints the graph.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "specdec"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("config", "tree", "text", "request", "metrics", "cache", "prompts", "cores"),
    ("verify", "logprobs", "events"),
    ("target",),  # model backends: loading, numerics, verifiers
    ("control", "heads"),  # costs, budgets, the bandit; trained head modules
    ("drafting",),  # DraftContext / Feedback: the speculator seam
    ("grammar",),
    ("speculators",),
    ("decode",),  # the public step: request state, proposal, phases, emitter
    ("batch",),
    ("engine",),
    ("training", "export", "bench"),
    ("server",),
    ("cli",),
    ("testing", ""),  # "" is the package's own __init__
)


@dataclass
class Graph:
    """Imports between the modules of one package, as found in its source."""

    package: str
    modules: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    private: list[str] = field(default_factory=list)  # "module:line imports other._name"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str | None) -> bool:
    return name is not None and name.startswith("_") and not name.startswith("__")


def _where(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def build_graph(root: Path, extra_sources: Iterable[Path] = ()) -> Graph:
    """The module graph of the package at ``root``; ``extra_sources`` (tests, tools) are only
    checked for private-name imports, from it and from each other."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    extra_sources = list(extra_sources)
    local = {p.stem for p in extra_sources}  # modules of the tests and tools themselves
    graph = Graph(root.name, modules)
    for name, path in [*modules.items(), *((str(p), p) for p in extra_sources)]:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = _type_checking_nodes(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[tuple[str, str | None]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level and name in modules:  # relative, inside the package
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join([*here, *([node.module] if node.module else [])])
                targets = [(base, a.name) for a in node.names]
            for mod, imported in targets:
                if mod != graph.package and not mod.startswith(graph.package + "."):
                    # a test or tool reaching into another one's private helpers
                    if _private(imported) and mod.rsplit(".", 1)[-1] in local:
                        where = f"{_where(path)}:{node.lineno}"
                        graph.private.append(f"{where} imports {mod}.{imported}")
                    continue
                full = f"{mod}.{imported}" if imported else mod
                target = full if full in modules else mod
                if name in modules and target != name:
                    graph.edges[name].add(target)
                if _private(imported) and full not in modules:
                    graph.private.append(f"{_where(path)}:{node.lineno} imports {mod}.{imported}")
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = iter(range(1 << 30))

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.edges.get(v, ())):
            if w not in graph.modules:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph.modules) + 100))
    try:
        for v in graph.modules:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def top_level(module: str, package: str) -> str:
    """The first component below the package (``specdec.target.loading`` -> ``target``)."""
    rest = module.removeprefix(package).lstrip(".")
    return rest.split(".")[0]


def layer_of(module: str, package: str, layers: tuple[tuple[str, ...], ...]) -> int:
    name = top_level(module, package)
    for i, members in enumerate(layers):
        if name in members:
            return i
    raise AssertionError(f"{module}: {name!r} is in no layer; add it to LAYERS (and the docs)")


def upward_imports(graph: Graph, layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Each import from a module to one in a higher layer, as ``a -> b``."""
    found = []
    for a in sorted(graph.edges):
        for b in sorted(graph.edges[a]):
            if layer_of(b, graph.package, layers) > layer_of(a, graph.package, layers):
                found.append(f"{a} -> {b}")
    return found


def _extra_sources() -> list[Path]:
    return [p for d in ("tests", "bench", "scripts") for p in sorted((ROOT / d).rglob("*.py"))]


def test_no_import_cycle_between_modules() -> None:
    assert cycles(build_graph(PACKAGE)) == []


def test_no_import_against_the_layer_order() -> None:
    assert upward_imports(build_graph(PACKAGE)) == []


def test_no_module_imports_another_modules_private_names() -> None:
    assert build_graph(PACKAGE, _extra_sources()).private == []


def test_every_top_level_module_has_a_layer() -> None:
    graph = build_graph(PACKAGE)
    for module in graph.modules:
        layer_of(module, graph.package, LAYERS)


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


def test_the_checks_catch_a_planted_upward_import_cycle_and_private_import(tmp_path: Path) -> None:
    """The rules are not vacuous: a low module importing a high one inside a function, a cycle
    through it, and a private name are all reported."""
    pkg = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "def f():\n    from pkg.high import g\n    return g\n",
            "high.py": "from pkg import low\nfrom pkg.low import _hidden\n\ndef g(): ...\n",
            "types.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high\n"
            ),
        },
    )
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("def _helper(): ...\n", encoding="utf-8")
    (tests / "test_b.py").write_text("from .test_a import _helper\n", encoding="utf-8")
    layers = (("low", "types"), ("high",), ("",))
    graph = build_graph(pkg, sorted(tests.glob("*.py")))
    assert upward_imports(graph, layers) == ["pkg.low -> pkg.high"]
    assert cycles(graph) == [["pkg.high", "pkg.low"]]
    assert graph.private == [
        f"{pkg / 'high.py'}:2 imports pkg.low._hidden",
        f"{tests / 'test_b.py'}:1 imports test_a._helper",
    ]


if __name__ == "__main__":
    g = build_graph(PACKAGE, _extra_sources())
    edges = defaultdict(set)
    for a, bs in g.edges.items():
        for b in bs:
            ta, tb = top_level(a, g.package), top_level(b, g.package)
            if ta != tb:
                edges[ta or "specdec"].add(tb or "specdec")
    for a in sorted(edges):
        print(f"{a} -> {', '.join(sorted(edges[a]))}")
    print("cycles:", cycles(g))
    print("upward:", upward_imports(g))
    print("private:", g.private)
