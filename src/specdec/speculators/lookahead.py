"""Lookahead decoding (Fu et al. 2024): Jacobi iteration and n-gram verification in ONE pass.

Each step's tree holds two branches under the root (the last committed token):

* the *lookahead branch*, a 2D window of ``W`` columns x up to ``N - 1`` levels of Jacobi
  guesses. Level 0 is a chain (column j at depth j + 1); level l column j sits at depth
  l + j + 1 under level l - 1 column j. So every window token attends to the committed prefix,
  the level-0 tokens up to its column and its own column's earlier levels, which is exactly
  the paper's lookahead mask, expressed as tree ancestry;
* the *verification branch*, up to ``G`` n-grams from the pool whose key is the root token.

Both are merged into one trie (a shared prefix is one node), verified by the ordinary tree
rules, and the target's argmax at the top level's nodes (read from the same pass's logits) is
the next Jacobi level. Columns of ``N - 1`` levels plus that output are n-grams for the pool.
Any accepted path is lossless whatever the window holds: the drafts are deterministic
(q = one-hot), so greedy output equals plain decoding and sampled output follows the target.

Knob defaults (W = 1, N = 3, G = 4) were chosen by measurement on a CPU with the bundled 135M
model (a ``specdec bench`` sweep of ``lookahead:WxNxG`` settings on training prompts;
experiments/training-free/2026-11-29-training-free.md). There every extra tree node costs a
share of a decode step (experiments/verification-cost/tree_cost.md), so every window column
costs about as much as it returns: a wider window raised tau, but its larger trees cost what
the extra tokens saved. The paper's GPU settings (W = 15, N = 5, G = 15, ~120 nodes) assume extra
tree nodes are nearly free, as on an accelerator; pass them there as
``lookahead:window=15,ngram=5,guesses=15,pool_per_key=15``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from specdec.errors import ConfigError
from specdec.speculators.base import DraftContext, Feedback, Speculator
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.target import LoadedModel
from specdec.tree import DraftTree


@dataclass(frozen=True, kw_only=True)
class LookaheadConfig(SpeculatorOptions):
    """``window`` W columns, ``ngram`` N (n-grams of N tokens, N - 1 Jacobi levels), ``guesses``
    G pool candidates verified per step, ``pool_per_key`` most recent n-grams kept per first
    token, ``context_ngrams``: also pool the request's own n-grams (prompt and output), which
    turns repeated text into free candidates as prompt lookup does."""

    window: int = option(1, help="W: Jacobi window columns")
    ngram: int = option(3, help="N: n-gram size (N - 1 Jacobi levels)")
    guesses: int = option(4, help="G: pool n-grams verified per step")
    pool_per_key: int = option(8, help="most recent n-grams kept per first token")
    context_ngrams: bool = option(True, help="also pool the request's own n-grams")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ConfigError(f"lookahead window W must be >= 1, got {self.window}")
        if self.ngram < 2:
            raise ConfigError(f"lookahead n-gram size N must be >= 2, got {self.ngram}")
        if self.guesses < 0:
            raise ConfigError(f"lookahead guesses G must be >= 0, got {self.guesses}")
        if self.pool_per_key < max(1, self.guesses):
            raise ConfigError(
                f"lookahead pool_per_key must be >= max(1, G) = {max(1, self.guesses)}; "
                "raise pool_per_key with guesses"
            )


class NgramPool:
    """n-grams keyed by their first token, the ``per_key`` most recently seen kept per key, each
    with the token seen before it. Lookup ranks continuations whose preceding token also matches
    first: one token of extra context makes a guess far likelier to be accepted, at no cost.

    >>> pool = NgramPool(per_key=3)
    >>> for prev, gram in [(0, (1, 2, 3)), (8, (1, 4, 5)), (0, (1, 2, 3)), (9, (1, 6, 7))]:
    ...     pool.add(gram, prev)
    >>> pool.lookup(1, 5)  # most recent first
    [(6, 7), (2, 3), (4, 5)]
    >>> pool.lookup(1, 2, prev=8)  # the one seen after 8 first
    [(4, 5), (6, 7)]
    >>> pool.lookup(9, 5)
    []
    """

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._grams: dict[int, OrderedDict[tuple[int, ...], int | None]] = {}

    def add(self, gram: Sequence[int], prev: int | None = None) -> None:
        key, rest = int(gram[0]), tuple(int(t) for t in gram[1:])
        bucket = self._grams.setdefault(key, OrderedDict())
        bucket[rest] = prev
        bucket.move_to_end(rest)  # most recent last
        if len(bucket) > self.per_key:
            bucket.popitem(last=False)

    def lookup(self, key: int, limit: int, prev: int | None = None) -> list[tuple[int, ...]]:
        """Up to ``limit`` continuations of ``key``: those seen after ``prev`` first, then the
        rest, each most recent first."""
        bucket = self._grams.get(key)
        if not bucket or limit <= 0:
            return []
        recent = list(reversed(bucket.items()))
        if prev is not None:
            recent.sort(key=lambda item: item[1] != prev)  # stable: keeps recency within ties
        return [rest for rest, _ in recent[:limit]]

    def __len__(self) -> int:
        return sum(len(b) for b in self._grams.values())


def jacobi_update(
    levels: list[list[int]], outputs: list[int], ngram: int
) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Append the target's outputs as the next level; once the window holds ``ngram - 1``
    levels, each column plus its output is an n-gram and the oldest level is dropped.

    >>> jacobi_update([[1, 2]], [5, 6], ngram=3)  # still filling: no n-grams yet
    ([[1, 2], [5, 6]], [])
    >>> jacobi_update([[1, 2], [5, 6]], [7, 8], ngram=3)
    ([[5, 6], [7, 8]], [(1, 5, 7), (2, 6, 8)])
    """
    grown = [*levels, list(outputs)]
    if len(grown) < ngram:
        return grown, []
    grams = [tuple(level[j] for level in grown) for j in range(len(outputs))]
    return grown[1:], grams


@dataclass(frozen=True)
class LookaheadTree:
    """The merged tree and, for each window level and column, its node index."""

    tree: DraftTree
    window_nodes: list[list[int]]  # [levels][W]


def build_lookahead_tree(
    root: int, levels: Sequence[Sequence[int]], guesses: Sequence[Sequence[int]]
) -> LookaheadTree:
    """One trie under ``root``: verification candidates first, then the window.

    Level 0 is a chain; level l column j hangs under level l - 1 column j (see module doc).

    >>> t = build_lookahead_tree(0, [[1, 2], [3, 4]], [[1, 9]])
    >>> t.tree.tokens, t.tree.parents
    ((0, 1, 9, 2, 3, 4), (-1, 0, 1, 1, 1, 3))
    >>> t.window_nodes  # level 0's first column is shared with the candidate (0, 1, 9)
    [[1, 3], [4, 5]]
    """
    tokens: list[int] = [int(root)]
    parents: list[int] = [-1]
    children: dict[tuple[int, int], int] = {}

    def child(parent: int, token: int) -> int:
        key = (parent, int(token))
        node = children.get(key)
        if node is None:
            node = len(tokens)
            tokens.append(int(token))
            parents.append(parent)
            children[key] = node
        return node

    for gram in guesses:
        node = 0
        for token in gram:
            node = child(node, token)
    window_nodes: list[list[int]] = []
    for lvl, level in enumerate(levels):
        row: list[int] = []
        for j, token in enumerate(level):
            parent = (row[j - 1] if j else 0) if lvl == 0 else window_nodes[lvl - 1][j]
            row.append(child(parent, token))
        window_nodes.append(row)
    return LookaheadTree(DraftTree(tuple(tokens), tuple(parents)), window_nodes)


class LookaheadSpeculator(Speculator):
    """Jacobi window + n-gram pool, per request (reset() starts a new one)."""

    name: ClassVar[str] = "lookahead"
    drafts_trees: ClassVar[bool] = True
    truncatable: ClassVar[bool] = False  # the Jacobi window is verified whole

    def __init__(self, config: LookaheadConfig | None = None) -> None:
        self.config = config or LookaheadConfig()
        self.reset()

    def reset(self) -> None:
        self.pool = NgramPool(self.config.pool_per_key)
        self.levels: list[list[int]] = []
        self._indexed_end = 0  # context n-grams pooled up to this token index
        self._pending: LookaheadTree | None = None

    def _pool_context(self, tokens: list[int]) -> None:
        n = self.config.ngram
        if len(tokens) < self._indexed_end:  # a new request without reset()
            self.reset()
        for end in range(max(self._indexed_end, n), len(tokens) + 1):
            self.pool.add(tokens[end - n : end], tokens[end - n - 1] if end > n else None)
        self._indexed_end = len(tokens)

    def _seed_window(self, tokens: list[int], prompt_len: int) -> None:
        """Level 0 starts as tokens drawn from the prompt (the paper's initialisation); a
        private RNG seeded by the prompt keeps drafts, hence sampled outputs, reproducible."""
        source = tokens[:prompt_len] or tokens
        rng = random.Random(hash(tuple(source[-64:])) & 0xFFFFFFFF)
        self.levels = [[rng.choice(source) for _ in range(self.config.window)]]

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        tokens = context.tokens
        root = tokens[-1]
        self._pending = None
        if budget < 1:
            return DraftTree.root_only(root)
        if self.config.context_ngrams:
            self._pool_context(tokens)
        if not self.levels:
            self._seed_window(tokens, context.prompt_len)
        prev = tokens[-2] if len(tokens) >= 2 else None
        guesses = self.pool.lookup(root, self.config.guesses, prev)
        built = build_lookahead_tree(root, self.levels, guesses)
        if built.tree.num_drafted > budget:  # the context is nearly full: draft nothing
            return DraftTree.root_only(root)
        self._pending = built
        return built.tree

    def observe(self, feedback: Feedback) -> None:
        built, self._pending = self._pending, None
        if built is None or feedback.logits is None or feedback.tree is not built.tree:
            return
        top = built.window_nodes[-1]
        outputs = feedback.logits[top].argmax(dim=-1).tolist()  # [W]
        first = self.levels[0]
        self.levels, grams = jacobi_update(self.levels, outputs, self.config.ngram)
        for j, gram in enumerate(grams):  # column j's predecessor: level 0's column j - 1
            self.pool.add(gram, first[j - 1] if j else None)


@register("lookahead", LookaheadConfig)
def _build(target: LoadedModel, options: LookaheadConfig) -> LookaheadSpeculator:
    """Jacobi iteration and n-gram verification in one pass (training-free)"""
    return LookaheadSpeculator(options)
