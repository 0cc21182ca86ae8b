"""Lookahead decoding: the Jacobi window update, the n-gram pool, the combined one-pass tree
(its attention mask and positions), greedy equivalence on tiny real models, and lossless
sampling through the statistical test of test_losslessness.

Greedy equivalence runs in float64, where a tree verification pass and single-token passes
agree to ~1e-15, so the comparison is exact equality of token ids.
"""

from __future__ import annotations

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.errors import ConfigError
from specdec.speculators import parse_spec
from specdec.speculators.lookahead import (
    LookaheadConfig,
    LookaheadSpeculator,
    NgramPool,
    build_lookahead_tree,
    jacobi_update,
)
from tests.test_losslessness import ALPHA, lossless_pvalue, make_engine


def test_jacobi_update_fills_then_slides():
    levels: list[list[int]] = [[1, 2, 3]]
    levels, grams = jacobi_update(levels, [4, 5, 6], ngram=4)
    assert levels == [[1, 2, 3], [4, 5, 6]] and grams == []
    levels, grams = jacobi_update(levels, [7, 8, 9], ngram=4)
    assert grams == []
    levels, grams = jacobi_update(levels, [10, 11, 12], ngram=4)
    # every column of the full window plus its new output is a 4-gram
    assert grams == [(1, 4, 7, 10), (2, 5, 8, 11), (3, 6, 9, 12)]
    assert levels == [[4, 5, 6], [7, 8, 9], [10, 11, 12]]


def test_pool_keeps_most_recent_per_key_and_is_bounded():
    pool = NgramPool(per_key=3)
    for i in range(10):
        pool.add((5, i, i + 1))
    assert pool.lookup(5, 10) == [(9, 10), (8, 9), (7, 8)]
    assert len(pool) == 3
    pool.add((5, 7, 8))  # seen again: becomes the most recent
    assert pool.lookup(5, 1) == [(7, 8)]


def test_combined_tree_reproduces_the_lookahead_mask_and_positions():
    """Window token (l, j) sees the root, level 0 columns 0..j and its own column's earlier
    levels; it sits at position prefix + l + j + 1. Verification n-grams see only the root and
    their own prefix. (Tokens are distinct so that no node is merged.)"""
    W, levels = 3, [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    guesses = [[40, 41, 42], [50, 51, 52]]
    built = build_lookahead_tree(1, levels, guesses)
    tree, nodes = built.tree, built.window_nodes
    mask = tree.ancestor_mask()
    pos = tree.position_ids(prefix_len=100).tolist()
    for lvl in range(3):
        for j in range(W):
            node = nodes[lvl][j]
            expected = {0} | {nodes[0][c] for c in range(j + 1)}
            expected |= {nodes[m][j] for m in range(lvl + 1)}
            assert set(mask[node].nonzero().flatten().tolist()) == expected
            assert pos[node] == 100 + lvl + j + 1
            assert tree.tokens[node] == levels[lvl][j]
    window = {n for row in nodes for n in row}
    for node in range(1, len(tree)):
        if node not in window:  # a verification node never sees the window
            assert not (set(mask[node].nonzero().flatten().tolist()) & window)
    assert len(tree) == 1 + 9 + 6


def test_shared_prefixes_are_one_node():
    built = build_lookahead_tree(1, [[7, 8]], [[7, 8, 9], [7, 3, 4]])
    assert built.tree.num_drafted == 5  # 7 -> {8 -> 9, 3 -> 4}: the window reuses 7 -> 8
    assert built.window_nodes == [[1, 2]]


def test_config_parsing_and_bad_values():
    parsed = parse_spec("lookahead:window=5,ngram=4,guesses=6")
    assert parsed == LookaheadConfig(window=5, ngram=4, guesses=6) and parsed.window == 5
    assert parse_spec("lookahead") == LookaheadConfig()
    bad_specs = [
        "lookahead:5,4",  # values without keys
        "lookahead:window=a,ngram=b,guesses=c",  # not integers
        "lookahead:window=0",  # W >= 1
        "lookahead:ngram=1",  # N >= 2
        "lookahead:guesses=9",  # more guesses than the pool keeps per key (8)
    ]
    for bad in bad_specs:
        with pytest.raises(ConfigError):
            parse_spec(bad)


@pytest.mark.parametrize(
    "setting",
    [
        "lookahead:window=4,ngram=3,guesses=4",
        "lookahead:window=2,ngram=2,guesses=1",
        "lookahead:window=3,ngram=5,guesses=5",
    ],
)
def test_greedy_equals_plain(tiny64, setting):
    from tests.test_equivalence_tiny import PROMPTS

    engine = SpeculativeEngine.from_pretrained(tiny64, speculator=setting)
    accepted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, speculate=False)
        spec = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, (setting, prompt)
        assert spec.stats.target_forwards <= plain.stats.target_forwards
        accepted += spec.stats.accepted_tokens
    assert accepted > 0  # drafts were accepted, not only rejected


class RecordingLookahead(LookaheadSpeculator):
    """Counts proposals in which some node has two or more children."""

    branching = 0

    def propose(self, context, budget):
        tree = super().propose(context, budget)
        if any(len(c) >= 2 for c in tree.children):
            RecordingLookahead.branching += 1
        return tree


@pytest.mark.slow(threads=1)
def test_lookahead_sampling_is_lossless():
    """Window and pool drafts are deterministic (q one-hot) trees that branch; through the
    multi-draft rejection rule the output must follow the target exactly."""
    RecordingLookahead.branching = 0
    speculator = RecordingLookahead(LookaheadConfig(window=2, ngram=2, guesses=2))
    pvalue = lossless_pvalue(make_engine(speculator=speculator))
    assert pvalue > ALPHA, f"lookahead sampling departs from p (chi-square p = {pvalue:.2e})"
    assert RecordingLookahead.branching > 1000  # the test exercised branching trees


def test_observe_ignores_a_tree_it_did_not_propose():
    spec = LookaheadSpeculator(LookaheadConfig(window=2, ngram=3, guesses=1))
    from specdec.speculators import Feedback
    from specdec.tree import DraftTree
    from specdec.verify import Acceptance

    tree = DraftTree.root_only(1)
    spec.observe(Feedback(tree, Acceptance((0,), (2,)), torch.zeros(1, 5)))
    assert spec.levels == []


def test_docstring_examples():
    import doctest

    from specdec.speculators import lookahead

    result = doctest.testmod(lookahead)
    assert result.failed == 0 and result.attempted > 0
