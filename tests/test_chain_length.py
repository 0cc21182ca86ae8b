"""A greedy draft-model chain that sizes itself token by token (``draft:...,length=auto``).

What is checked: greedy output identical to plain decoding (float64 target and draft, so the
verification pass and single-token passes agree to the last bit); the chain runs long where the
draft is sure and right (the target's own weights draft) and short, or not at all, where it is
neither (an unrelated random draft); sampled requests keep the engine's timing-free budget; the
option's bad values fail before anything loads."""

from __future__ import annotations

import pytest

from specdec import GenerationConfig, SamplingConfig, SpeculativeEngine
from specdec.control.budget import AdaptiveBudget, FixedBudget
from specdec.errors import ConfigError
from specdec.speculators import DraftModelSpeculator
from specdec.speculators.draft_model import DEFAULT_CHAIN_DEPTH
from specdec.speculators.spec import parse_spec
from specdec.target import HFTarget, ModelRunner, load_model

PROMPTS = ["the cat sat on the mat", "one two three four five six", "a b c a b c a b"]


@pytest.fixture(scope="module")
def pair64(tiny_model_dir, tiny_draft_dir):
    return load_model(str(tiny_model_dir), dtype="float64"), load_model(
        str(tiny_draft_dir), dtype="float64"
    )


def _engine(target, spec: DraftModelSpeculator) -> SpeculativeEngine:
    return SpeculativeEngine(HFTarget(target), target.tokenizer, spec, loaded=target)


def _lengths(spec: DraftModelSpeculator) -> list[int]:
    """Record the length of every chain ``spec`` drafts."""
    seen: list[int] = []
    original = spec.propose

    def propose(context, budget):
        tree = original(context, budget)
        seen.append(tree.num_drafted)
        return tree

    spec.propose = propose  # type: ignore[method-assign]
    return seen


def test_length_option_parses_and_bad_values_fail_before_loading():
    assert parse_spec("draft:model=/nowhere").length == "auto"
    assert parse_spec("draft:model=/nowhere,length=budget").length == "budget"
    with pytest.raises(ConfigError, match="length="):
        parse_spec("draft:model=/nowhere,length=sometimes")


def test_budget_policy_follows_the_chain_length_and_sampling(pair64):
    target, draft = pair64
    auto = _engine(target, DraftModelSpeculator(ModelRunner(draft.model)))
    greedy, sampled = GenerationConfig(), GenerationConfig(sampling=SamplingConfig(temperature=0.7))
    policy = auto.budget_policy(greedy)
    assert isinstance(policy, FixedBudget) and policy.num_draft_tokens == DEFAULT_CHAIN_DEPTH
    # sampled drafts consume the request's random numbers: their length must not depend on
    # timing or on other requests, so they keep the engine's budget with its frozen prices
    assert isinstance(auto.budget_policy(sampled), AdaptiveBudget)
    capped = _engine(target, DraftModelSpeculator(ModelRunner(draft.model), max_depth=6))
    assert capped.budget_policy(greedy).num_draft_tokens == 6
    budget = _engine(target, DraftModelSpeculator(ModelRunner(draft.model), length="budget"))
    assert isinstance(budget.budget_policy(greedy), AdaptiveBudget)
    with pytest.raises(ConfigError, match="length"):
        DraftModelSpeculator(ModelRunner(draft.model), length="sometimes")


def test_a_k_that_is_asked_for_caps_a_self_stopping_chain(pair64, tiny_draft_dir):
    """``-k K`` (``num_draft_tokens``) caps every draft, a self-stopping chain's too; without
    it the chain keeps its own cap. Checked on the budget offered to the speculator."""
    target, _ = pair64
    offered: dict[str, set[int]] = {}
    for name, k in (("given", 2), ("default", None)):
        engine = SpeculativeEngine.from_pretrained(
            target, speculator=f"draft:model={tiny_draft_dir}", num_draft_tokens=k
        )
        assert engine.budget_policy(GenerationConfig()).num_draft_tokens == (
            2 if k else DEFAULT_CHAIN_DEPTH
        )
        spec = engine.speculator
        seen = offered.setdefault(name, set())
        original = spec.propose

        def propose(context, budget, original=original, seen=seen):
            seen.add(budget)
            return original(context, budget)

        spec.propose = propose
        engine.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    assert offered["given"] and max(offered["given"]) <= 2
    assert max(offered["default"]) > 2


@pytest.mark.parametrize("own", [False, True], ids=["random-draft", "own-weights"])
def test_self_sized_chain_matches_plain_decoding(pair64, own):
    """Exactness: float64 target, so a k-token verification pass and k single-token passes
    agree to the last bit and the comparison is exact, not "mostly equal"."""
    target, draft = pair64
    plain_engine = SpeculativeEngine.from_pretrained(target, speculator="none")
    plain = [
        plain_engine.generate(p, max_new_tokens=40, speculate=False).token_ids for p in PROMPTS
    ]
    spec = DraftModelSpeculator(ModelRunner(target.model if own else draft.model), max_depth=8)
    lengths = _lengths(spec)
    engine = _engine(target, spec)
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        assert engine.generate(prompt, max_new_tokens=40).token_ids == expected
    assert lengths


def test_chain_runs_long_where_the_draft_is_sure_and_short_where_it_is_not(pair64):
    target, draft = pair64
    own = DraftModelSpeculator(ModelRunner(target.model), max_depth=8)
    own._forward_cost = lambda context: 0.05  # type: ignore[method-assign]  # a cheap draft
    own_lengths = _lengths(own)
    engine = _engine(target, own)
    for prompt in PROMPTS:
        engine.generate(prompt, max_new_tokens=48)
    drafted = [n for n in own_lengths if n]
    # the target drafting for itself is always accepted, though a random model's softmax is
    # flat (its confidence ~0.05): the calibration learns that these confidences are always
    # right, and chains grow to the cap (a confidence threshold would stop at one token)
    half = len(drafted) // 2
    early, late = drafted[:half], drafted[half:]
    assert max(drafted) == 8, own_lengths
    assert sum(late) / len(late) >= 5.0 > sum(early) / len(early), own_lengths
    assert own._rate > 2.0  # committed tokens per target step, learnt from its steps

    other = DraftModelSpeculator(ModelRunner(draft.model), max_depth=8)
    other._forward_cost = lambda context: 0.3  # type: ignore[method-assign]
    other_lengths = _lengths(other)
    engine = _engine(target, other)
    for prompt in PROMPTS:
        engine.generate(prompt, max_new_tokens=48)
    # an unrelated random draft is unsure of every token (its softmax is flat) and wrong: it
    # drafts one token and stops, then stops drafting except for a probe every 8 steps
    assert max(other_lengths) <= 2, other_lengths
    assert other_lengths.count(0) > len(other_lengths) / 2, other_lengths


def test_adaptive_false_drafts_k_every_step(pair64):
    """``adaptive=False`` is documented as "always drafts K": the chain does not stop itself."""
    target, draft = pair64
    spec = DraftModelSpeculator(ModelRunner(draft.model))
    lengths = _lengths(spec)
    engine = SpeculativeEngine(
        HFTarget(target), target.tokenizer, spec, loaded=target, num_draft_tokens=4, adaptive=False
    )
    engine.generate(PROMPTS[0], max_new_tokens=30)
    # the random draft is always rejected, so each step commits one token; at the end only
    # the request's remaining tokens cap the draft (min(K, remaining - 1))
    assert lengths == [4] * (len(lengths) - 3) + [3, 2, 1], lengths
