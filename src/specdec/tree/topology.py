"""Static token-tree topologies for speculators that propose ranked candidates per depth
(Medusa heads, EAGLE-1 style static trees).

A topology is a tuple of *paths*: ``(r1, r2, ..., rd)`` is the node reached by taking the
rank-r1 candidate at depth 1, then the rank-r2 candidate at depth 2, and so on. Paths are ordered
so that every node comes after its parent, hence any prefix of a topology is itself a tree and
truncating to a node budget is safe.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError
from specdec.tree.draft_tree import DraftTree

Path_ = tuple[int, ...]
Topology = tuple[Path_, ...]


def validate_topology(paths: Sequence[Sequence[int]], num_heads: int | None = None) -> Topology:
    """Check shape and parent-before-child order; return the canonical tuple form.

    >>> validate_topology([[0], [1], [0, 0]])
    ((0,), (1,), (0, 0))
    """
    seen: set[Path_] = {()}
    out: list[Path_] = []
    for p in paths:
        path = tuple(int(r) for r in p)
        if not path or any(r < 0 for r in path):
            raise ConfigError(f"tree topology path {list(p)} must be non-empty ranks >= 0")
        if path in seen:
            raise ConfigError(f"tree topology repeats path {list(path)}")
        if path[:-1] not in seen:
            raise ConfigError(
                f"tree topology path {list(path)} comes before its parent {list(path[:-1])}"
            )
        if num_heads is not None and len(path) > num_heads:
            raise ConfigError(
                f"tree topology path {list(path)} has depth {len(path)} but only {num_heads} "
                "heads exist; use a topology for at most that many heads"
            )
        seen.add(path)
        out.append(path)
    if not out:
        raise ConfigError("a tree topology needs at least one path")
    return tuple(out)


def calibrated_topology(accuracy: Sequence[Sequence[float]], num_nodes: int) -> Topology:
    """The ``num_nodes``-node tree with the highest expected accepted length, built greedily
    the way Medusa builds its sparse tree: a node's value is the product of the measured
    accuracies along its path (``accuracy[d][r]`` = P(the rank-r candidate at depth d+1 is the
    target's token | the first candidates before it were), which is the path's probability
    when the figures are conditional, as ``specdec train medusa`` measures them), and the best
    node whose parent is already in the tree is added next.

    >>> calibrated_topology([[0.6, 0.2], [0.5, 0.1]], 3)
    ((0,), (0, 0), (1,))
    """
    if num_nodes < 1:
        raise ConfigError(f"a tree needs at least one node, got {num_nodes}")
    depth = len(accuracy)
    frontier: list[tuple[float, Path_]] = []

    def push_children(path: Path_, value: float) -> None:
        if len(path) < depth:
            for r, a in enumerate(accuracy[len(path)]):
                if a > 0:
                    heapq.heappush(frontier, (-value * a, (*path, r)))

    push_children((), 1.0)
    chosen: list[Path_] = []
    while frontier and len(chosen) < num_nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        push_children(path, -neg)
    if not chosen:
        raise ConfigError("no candidate has positive measured accuracy; cannot build a tree")
    return tuple(chosen)


def expected_accepted(topology: Topology, accuracy: Sequence[Sequence[float]]) -> float:
    """Expected accepted drafts per step under independent per-depth accuracies.

    >>> round(expected_accepted(((0,), (0, 0), (1,)), [[0.6, 0.2], [0.5, 0.1]]), 3)
    1.1
    """
    return sum(
        math.prod(accuracy[d][r] for d, r in enumerate(path) if r < len(accuracy[d]))
        if all(r < len(accuracy[d]) for d, r in enumerate(path))
        else 0.0
        for path in topology
    )


def accepted_lengths(topology: Topology, match: torch.Tensor) -> torch.Tensor:
    """How many drafts a greedy tree walk over ``topology`` accepts at each position: the
    depth of the deepest path all of whose nodes were right. Measured, not assumed
    independent, so it checks ``expected_accepted`` (and the tree sizing built on it).
    match [B, D, R] bool: the rank-r candidate at depth d+1 was the target's token.

    >>> m = torch.tensor([[[True, False], [False, True]], [[False, True], [True, False]]])
    >>> accepted_lengths(((0,), (0, 0), (1,), (0, 1)), m).tolist()
    [2, 1]
    """
    depth, ranks = match.shape[1], match.shape[2]
    best = torch.zeros(match.shape[0], dtype=torch.long)  # [B]
    hits: dict[Path_, torch.Tensor] = {(): torch.ones_like(best, dtype=torch.bool)}
    for path in topology:  # parents come first, so a node extends its parent's hits
        parent = hits.get(path[:-1])
        if parent is None or len(path) > depth or path[-1] >= ranks:
            continue  # never right: the candidates it needs were not ranked
        hits[path] = parent & match[:, len(path) - 1, path[-1]]  # [B]
        best = torch.where(hits[path], torch.clamp_min(best, len(path)), best)
    return best


def preset_names() -> list[str]:
    return sorted(_presets())


def _presets_file() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        resources.files("specdec.tree").joinpath("presets.json").read_text()
    )
    return data


def _presets() -> dict[str, list[list[int]]]:
    topologies: dict[str, list[list[int]]] = _presets_file()["topologies"]
    return topologies


def generic_profile() -> list[list[float]]:
    """The generic per-depth accuracy profile the presets were built from, for heads that
    carry no measured accuracies (checkpoints in the original Medusa format)."""
    profile: list[list[float]] = _presets_file()["profile"]
    return profile


def load_topology(spec: str, num_heads: int) -> Topology:
    """A preset name or a JSON file holding a list of paths."""
    presets = _presets()
    if spec in presets:
        paths = presets[spec]
    else:
        p = Path(spec)
        if not p.is_file():
            raise ConfigError(
                f"unknown tree {spec!r}: not a preset ({', '.join(sorted(presets))}) "
                "and not a JSON file"
            )
        try:
            paths = json.loads(p.read_text())
        except ValueError as e:
            raise ConfigError(f"tree file {p} is not valid JSON: {e}") from e
        if not isinstance(paths, list):
            raise ConfigError(f"tree file {p} must hold a JSON list of paths")
    return validate_topology(paths, num_heads)


def tree_from_topology(
    root: int, topology: Topology, candidates: Sequence[Sequence[int]], budget: int
) -> DraftTree:
    """Instantiate ``topology`` with ranked candidate tokens per depth (``candidates[d][r]``),
    keeping at most ``budget`` drafted nodes (a prefix of the topology, hence a tree).

    >>> t = tree_from_topology(9, ((0,), (1,), (0, 0)), [[5, 6], [7, 8]], budget=3)
    >>> t.tokens, t.parents
    ((9, 5, 6, 7), (-1, 0, 0, 1))
    """
    index: dict[Path_, int] = {(): 0}
    tokens = [int(root)]
    parents = [-1]
    for path in topology:
        if len(tokens) - 1 >= budget:
            break
        d = len(path)
        if d > len(candidates) or path[-1] >= len(candidates[d - 1]):
            continue
        parent = index.get(path[:-1])
        if parent is None:
            continue
        index[path] = len(tokens)
        tokens.append(int(candidates[d - 1][path[-1]]))
        parents.append(parent)
    return DraftTree(tokens=tuple(tokens), parents=tuple(parents))
