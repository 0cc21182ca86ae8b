"""Pure pieces with worked examples: trees, sampling transforms, rules on hand-built logits,
prompt lookup, stop strings, incremental detokenization, budgets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.cache import common_prefix_len
from specdec.config import SamplingConfig
from specdec.control import FixedBudget
from specdec.speculators import DraftContext, PromptLookupSpeculator
from specdec.text import IncrementalDetokenizer, StopMatcher
from specdec.tree import DraftTree
from specdec.verify import GreedyRule, RejectionSamplingRule, make_generator, probs_from_logits

GREEDY = SamplingConfig()


def onehot_logits(rows: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        logits[i, t] = 5.0
    return logits


# -- DraftTree -----------------------------------------------------------------------------------
def test_tree_structure_is_derived():
    tree = DraftTree(tokens=(9, 1, 2, 3, 4), parents=(-1, 0, 0, 1, 3))
    assert tree.depths == (0, 1, 1, 2, 3)
    assert tree.children == ((1, 2), (3,), (), (4,), ())
    assert tree.position_ids(10).tolist() == [10, 11, 11, 12, 13]
    assert tree.path_to(4) == [0, 1, 3, 4]
    assert not tree.is_chain
    mask = tree.ancestor_mask()
    assert mask[4].tolist() == [True, True, False, True, True]
    assert mask[2].tolist() == [True, False, True, False, False]


@pytest.mark.parametrize(
    "tokens,parents",
    [((), ()), ((1, 2), (-1,)), ((1, 2), (0, 0)), ((1, 2, 3), (-1, 2, 0)), ((1, 2), (-1, 1))],
)
def test_tree_rejects_malformed(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens=tokens, parents=parents)


def test_chain_and_root_only():
    assert DraftTree.chain(5, [6, 7]).is_chain
    empty = DraftTree.root_only(5)
    assert empty.num_drafted == 0 and empty.tokens == (5,)


# -- sampling transforms ---------------------------------------------------------------------------
def test_top_k_and_top_p_shape_probabilities():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=3))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]  # the nucleus never empties


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    hot = probs_from_logits(logits, SamplingConfig(temperature=2.0))[0, 1]
    cold = probs_from_logits(logits, SamplingConfig(temperature=0.5))[0, 1]
    assert cold > hot


# -- rules on hand-built logits --------------------------------------------------------------------
def test_greedy_rule_accepts_longest_matching_prefix():
    tree = DraftTree.chain(0, [3, 4, 9])
    # target argmax after root=3, after 3 -> 4, after 4 -> 5 (draft said 9), after 9 -> 1
    acc = GreedyRule().accept(tree, onehot_logits([3, 4, 5, 1]), GREEDY, make_generator(0))
    assert acc.path == (0, 1, 2) and acc.tokens == (3, 4, 5)


def test_greedy_rule_bonus_when_all_accepted():
    tree = DraftTree.chain(0, [3, 4])
    acc = GreedyRule().accept(tree, onehot_logits([3, 4, 7]), GREEDY, make_generator(0))
    assert acc.path == (0, 1, 2) and acc.tokens == (3, 4, 7)


def test_greedy_rule_walks_the_matching_branch():
    tree = DraftTree(tokens=(0, 3, 4, 6, 8), parents=(-1, 0, 0, 2, 2))
    logits = onehot_logits([4, 0, 8, 0, 2])  # root -> 4 (node 2), then 8 (node 4), then 2
    acc = GreedyRule().accept(tree, logits, GREEDY, make_generator(0))
    assert acc.path == (0, 2, 4) and acc.tokens == (4, 8, 2)


def test_rejection_rule_with_p_equal_q_accepts_everything():
    logits = torch.randn(4, 6)
    cfg = SamplingConfig(temperature=1.0)
    p = probs_from_logits(logits, cfg)  # [4, V], row i predicts node i's child
    q = torch.cat([torch.zeros(1, 6), p[:-1]])  # row i: the distribution node i was drawn from
    tokens = [0, int(p[0].argmin()), int(p[1].argmin()), int(p[2].argmin())]  # unlikely ones
    tree = DraftTree(tuple(tokens), (-1, 0, 1, 2), q)
    for seed in range(20):
        acc = RejectionSamplingRule().accept(tree, logits, cfg, make_generator(seed))
        assert acc.num_accepted == 3


def test_rejection_rule_never_emits_a_token_outside_p():
    cfg = SamplingConfig(temperature=1.0, top_k=2)
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]] * 3)
    tree = DraftTree.chain(0, [3, 3])  # deterministic drafts of a token p gives 0
    for seed in range(50):
        acc = RejectionSamplingRule().accept(tree, logits, cfg, make_generator(seed))
        assert acc.num_accepted == 0 and acc.tokens[0] in (1, 2)


# -- prompt lookup -------------------------------------------------------------------------------
def ctx(tokens: list[int]) -> DraftContext:
    return DraftContext(tokens, len(tokens), GREEDY, make_generator(0))


def test_prompt_lookup_prefers_longest_then_latest_match():
    spec = PromptLookupSpeculator(max_ngram=3, min_ngram=1)
    # (1, 2) occurs at 0 and 4; the latest earlier occurrence (4-5) is followed by 7, 8
    tokens = [1, 2, 3, 9, 1, 2, 7, 8, 5, 1, 2]
    assert spec.propose(ctx(tokens), 3).tokens == (2, 7, 8, 5)


def test_prompt_lookup_no_match_is_an_empty_draft():
    spec = PromptLookupSpeculator(max_ngram=3, min_ngram=2)
    assert spec.propose(ctx([1, 2, 3, 4]), 5).num_drafted == 0


def test_prompt_lookup_indexes_incrementally_and_resets():
    spec = PromptLookupSpeculator(max_ngram=2, min_ngram=1)
    tokens = [4, 5, 6]
    assert spec.propose(ctx(tokens), 2).num_drafted == 0
    tokens += [4]
    assert spec.propose(ctx(tokens), 2).tokens == (4, 5, 6)
    spec.reset()
    assert spec.propose(ctx([7, 7]), 2).tokens == (7, 7)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 6))
def test_prompt_lookup_drafts_a_real_continuation(tokens, budget):
    """Property: whatever it drafts followed an earlier occurrence of the current suffix."""
    tree = PromptLookupSpeculator(3, 1).propose(ctx(tokens), budget)
    drafts = list(tree.tokens[1:])
    assert len(drafts) <= budget
    if drafts:
        n = len(tokens)
        hits = [
            j
            for j in range(n - 1)
            if tokens[j] == tokens[-1] and tokens[j + 1 : j + 1 + len(drafts)] == drafts
        ]
        assert hits


# -- stop strings and detokenization -------------------------------------------------------------
def test_stop_matcher_holds_back_partial_matches_and_cuts_at_stop():
    m = StopMatcher(["\n\nUser:", "###"])
    out = [m.feed(d) for d in ["Hello", " world\n", "\nUs", "er: hi"]]
    assert out == [("Hello", False), (" world", False), ("", False), ("", True)]
    m = StopMatcher(["###"])
    assert m.feed("a#") == ("a", False)
    assert m.feed("b") == ("#b", False)  # the held '#' was not a stop after all
    assert m.flush() == ""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="ab#", max_size=4), max_size=12))
def test_stop_matcher_emits_exactly_the_text_before_the_first_stop(pieces):
    m = StopMatcher(["##", "ba#"])
    emitted, hit = "", False
    for piece in pieces:
        out, hit = m.feed(piece)
        emitted += out
        if hit:
            break
    if not hit:
        emitted += m.flush()
    full = "".join(pieces)
    cuts = [i for s in ("##", "ba#") if (i := full.find(s)) >= 0]
    assert emitted == (full[: min(cuts)] if cuts else full)


def test_incremental_detokenizer_equals_full_decode(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "Ünïcödé — naïve café, 東京 and emoji 🎭 in Shakespeare's words."
    ids = tok(text)["input_ids"]
    prompt = tok("KING:")["input_ids"]
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.push(t) for t in ids) == tok.decode(ids)


def test_common_prefix_and_budget():
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([], [1]) == 0
    assert FixedBudget(5).choose(remaining_tokens=1, context_room=100) == 0
    assert FixedBudget(5).choose(remaining_tokens=100, context_room=3) == 2


def test_adaptive_budget_counts_drafting_time():
    """A draft that costs most of a target pass per token must not be used at mediocre
    acceptance, and the docstring's worked examples hold."""
    import doctest

    from specdec.control import AdaptiveBudget, CostModel, budget

    assert doctest.testmod(budget).failed == 0
    costs = CostModel(seconds={1: 1.0})
    for _ in range(20):
        costs.observe_draft(4, 4 * 0.8)  # 0.8 s per drafted token
    assert abs(costs.draft_seconds_per_token - 0.8) < 1e-9
    assert AdaptiveBudget(5, costs, alphas=[0.6] * 5).choose(100, 100) == 0
    assert AdaptiveBudget(5, costs, alphas=[0.95] * 5).choose(100, 100) > 0
    frozen = CostModel.prior()
    frozen.observe_draft(4, 100.0)  # sampled requests' prior never learns timings
    assert frozen.draft_seconds_per_token == 0.0
