"""Draft-model trees: greedy output identical to plain decoding, the draft's cache consistent
with its tree masks across steps, forks drafting independently, and sampled output through a
draft-model tree following exactly the target's distribution (chi-square, with a power check
against a rule that treats siblings drawn without replacement as independent draws)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import GenerationConfig, SamplingConfig, SpeculativeEngine
from specdec.errors import ConfigError
from specdec.speculators import DraftContext, DraftModelSpeculator, DraftOptions
from specdec.speculators.draft_model import TreeShape
from specdec.speculators.spec import parse_spec
from specdec.target import HFTarget, LoadedModel, ModelRunner, load_model
from specdec.testing import word_tokenizer
from specdec.verify import probs_from_logits
from tests.test_losslessness import chi_square_pvalue

# -- spec ------------------------------------------------------------------------------------


def test_tree_option_parses_and_bad_trees_fail_before_loading():
    opts = parse_spec("draft:model=/nowhere,tree=2x3@0.8")
    assert isinstance(opts, DraftOptions) and opts.tree == "2x3@0.8"
    assert TreeShape.parse(opts.tree) == TreeShape(2, 3, 0.8, 4)
    assert TreeShape.parse("chain") is None and parse_spec("draft:model=x").tree == "chain"
    assert TreeShape.parse("auto") is not None
    for bad in ("2x", "wide", "0x2", "2x2@1.5"):
        with pytest.raises(ConfigError, match="tree="):
            parse_spec(f"draft:model=/nowhere,tree={bad}")


# -- greedy: identical output, consistent cache --------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir, tiny_draft_dir):
    target = load_model(str(tiny_model_dir))
    draft = load_model(str(tiny_draft_dir))
    return target, draft


PROMPTS = ["the cat sat on the mat", "one two three four five six", "a b c a b c a b"]


def _draft_argmax(model, tokens: list[int]) -> int:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    return int(logits.argmax())


@pytest.mark.parametrize("own", [False, True], ids=["draft", "self"])
@pytest.mark.parametrize("tree", ["auto", "2x2", "3x3", "1x0"])
def test_greedy_draft_trees_match_plain_decoding(tiny_pair, tree, own):
    """``own``: the target's own weights draft (always accepted, priced as cheap), so that
    trees grow deep and the cache is checked at every depth."""
    target, draft = tiny_pair
    drafter = target.model if own else draft.model
    spec = DraftModelSpeculator(ModelRunner(drafter), tree=TreeShape.parse(tree), max_depth=4)
    if own:
        spec._forward_cost = lambda context: 0.05  # type: ignore[method-assign]
    engine = SpeculativeEngine.from_pretrained(target, speculator="none")
    plain = [engine.generate(p, max_new_tokens=40, speculate=False).token_ids for p in PROMPTS]
    engine = SpeculativeEngine(HFTarget(target), target.tokenizer, spec, loaded=target)
    trees, checked, deepest = [], 0, 0
    original = spec.propose

    def propose(context, budget):
        nonlocal checked, deepest
        t = original(context, budget)
        trees.append(t)
        # every node's first child is the draft's argmax after the node's own path: the tree
        # masks over the draft's cache (and its compaction after each step) are right
        for node, kids in enumerate(t.children):
            if kids and checked < 60:
                path = [t.tokens[i] for i in t.path_to(node)[1:]]
                assert t.tokens[kids[0]] == _draft_argmax(drafter, context.tokens + path)
                checked += 1
                deepest = max(deepest, t.depths[node])
        return t

    spec.propose = propose
    for prompt, want in zip(PROMPTS, plain, strict=True):
        got = engine.generate(prompt, max_new_tokens=40)
        assert got.token_ids == want, (tree, prompt)
    assert checked > 0
    if tree in ("2x2", "3x3"):
        assert any(not t.is_chain for t in trees), "no step drafted a branching tree"
    if tree == "1x0":
        assert all(t.is_chain for t in trees)
    if own:
        assert deepest >= 2, "trees never grew past depth 2"


def test_draft_trees_from_a_spec(tiny_pair, tiny_draft_dir):
    target, _ = tiny_pair
    engine = SpeculativeEngine.from_pretrained(
        target, speculator=f"draft:model={tiny_draft_dir},tree=2x2,k=4"
    )
    assert engine.speculator.drafts_trees and engine.speculator.max_depth == 4
    for prompt in PROMPTS[:2]:
        got = engine.generate(prompt, max_new_tokens=24)
        plain = engine.generate(prompt, max_new_tokens=24, speculate=False)
        assert got.token_ids == plain.token_ids
    chain = SpeculativeEngine.from_pretrained(target, speculator=f"draft:model={tiny_draft_dir}")
    assert not chain.speculator.drafts_trees  # the default stays the adaptive chain


# -- fork --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [None, "2x2"])
def test_forks_draft_independently(tiny_pair, tree):
    """Interleaving two forks' drafts on two contexts gives each the drafts it makes alone;
    the forks share the model's weights, not a KV cache."""
    target, draft = tiny_pair
    base = DraftModelSpeculator(ModelRunner(draft.model), tree=TreeShape.parse(tree))
    a, b = base.fork(), base.fork()
    assert a.runner.model is draft.model and b.runner.model is draft.model
    assert a.runner.cache is not b.runner.cache and a.runner.cache is not base.runner.cache
    tok = target.tokenizer
    seqs = [tok.encode(PROMPTS[0]) + tok.encode(PROMPTS[2]), tok.encode(PROMPTS[1]) * 2]

    def ctx(tokens):
        return DraftContext(list(tokens), 2, SamplingConfig(), torch.Generator())

    def drafts(spec, tokens):  # propose after each growing prefix, as steps would
        out = []
        for n in range(3, len(tokens), 3):
            t = spec.propose(ctx(tokens[:n]), 4)
            out.append((t.tokens, t.parents))
        return out

    alone = [drafts(base.fork(), s) for s in seqs]
    together: list[list] = [[], []]
    for n in range(3, max(len(s) for s in seqs), 3):
        for spec, s, out in ((a, seqs[0], together[0]), (b, seqs[1], together[1])):
            if n < len(s):
                t = spec.propose(ctx(s[:n]), 4)
                out.append((t.tokens, t.parents))
    assert together == alone


# -- sampling: the distribution through a draft-model tree ------------------------------------

V, N_NEW, SAMPLES, ALPHA = 6, 3, 2_500, 1e-3
SAMPLING = dict(temperature=0.9, top_p=0.95)


def _tiny_lm(seed: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V + 1,  # t0..t5 and <eos>, an ordinary token here (ignore_eos)
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=V,
        pad_token_id=V,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def sampling_pair():
    tok = word_tokenizer(V)
    target = LoadedModel(_tiny_lm(0, 2), tok, "tiny target", "fp32", "float32")
    draft = _tiny_lm(7, 1)
    return target, draft


def exact_joint(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    cfg = SamplingConfig(**SAMPLING)
    joint = {}
    for seq in itertools.product(range(V + 1), repeat=N_NEW):
        prob, ctx = 1.0, list(prompt)
        for t in seq:
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ctx])).logits[0, -1:]
            prob *= float(probs_from_logits(logits.double(), cfg)[0, t])
            ctx.append(t)
            if prob == 0.0:
                break
        joint[seq] = prob
    return joint


def sample_joint(engine: SpeculativeEngine, prompt: list[int]) -> Counter:
    counts: Counter = Counter()
    for seed in range(SAMPLES):
        config = GenerationConfig(
            max_new_tokens=N_NEW, ignore_eos=True, sampling=SamplingConfig(**SAMPLING, seed=seed)
        )
        ids: list[int] = []
        for event in engine.stream_ids(prompt, config):
            ids.extend(event.token_ids)
        counts[tuple(ids)] += 1
    return counts


def tree_pvalue(counts: Counter, joint: dict[tuple[int, ...], float]) -> float:
    return chi_square_pvalue(counts, joint, SAMPLES)


class _IndependentRows(DraftModelSpeculator):
    """Wrong on purpose: draws siblings without replacement but hands verification the
    unchanged q for each, as if they had been drawn independently."""

    def _children(self, q, width, greedy, context):
        return [(t, c, q if row is not None else None)
                for t, c, row in super()._children(q, width, greedy, context)]  # fmt: skip


def tree_engine(pair, cls=DraftModelSpeculator) -> tuple[SpeculativeEngine, list]:
    target, draft = pair
    # priced as cheap, so that every step drafts a 3-wide tree two deep (up to 12 nodes)
    spec = cls(ModelRunner(draft), tree=TreeShape(3, 2), max_depth=2, cost_prior=0.05)
    trees: list = []
    original = spec.propose

    def propose(context, budget):
        t = original(context, budget)
        trees.append(t)
        return t

    spec.propose = propose
    return SpeculativeEngine(HFTarget(target), target.tokenizer, spec, loaded=target), trees


@pytest.mark.slow(threads=1)
def test_sampled_draft_trees_follow_the_target_and_the_test_has_power(sampling_pair):
    target, draft = sampling_pair
    prompt = [1, 4]
    joint = exact_joint(target.model, prompt)
    # the draft differs clearly from the target at the first token
    cfg = SamplingConfig(**SAMPLING)
    with torch.inference_mode():
        p = probs_from_logits(target.model(input_ids=torch.tensor([prompt])).logits[0, -1:], cfg)
        q = probs_from_logits(draft(input_ids=torch.tensor([prompt])).logits[0, -1:], cfg)
    assert float(0.5 * (p - q).abs().sum()) > 0.2
    engine, trees = tree_engine(sampling_pair)
    pvalue = tree_pvalue(sample_joint(engine, prompt), joint)
    assert pvalue > ALPHA, f"draft-model trees depart from p (chi-square p = {pvalue:.2e})"
    # the trees branched and drafts were accepted (the test exercised the multi-draft rule)
    assert sum(len(t.children[0]) > 1 for t in trees) > SAMPLES // 2
    long = engine.generate("t1 t4", max_new_tokens=40, ignore_eos=True, temperature=0.9, seed=0)
    assert long.stats.mean_accepted > 1.3
    wrong, _ = tree_engine(sampling_pair, _IndependentRows)
    bad = tree_pvalue(sample_joint(wrong, prompt), joint)
    assert bad < ALPHA, f"independent-draw rows for w/o-replacement siblings undetected ({bad:.2e})"


# -- the adaptive chain budget ----------------------------------------------------------------


def _run_budget(budget, steps: int, accept_all: bool = True) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = budget.choose(remaining_tokens=100, context_room=1000)
        chosen.append(k)
        budget.observe(k, k if accept_all else 0)
    return chosen


def test_adaptive_budget_learns_that_longer_drafts_pay():
    """Every drafted token accepted, verification flat up to 6 tokens, drafting 0.3 of a target
    step per token: the budget must reach K = 5 (fixed K's tau) instead of staying at the short
    lengths it started with. On the Qwen pair it drafted 2 per step for a whole answer whose
    first two positions were accepted 97-100% of the time (positions never drafted kept the
    0.6 prior); the same loop with that estimator shows it here."""
    from specdec.control import AdaptiveBudget, CostModel

    def costs():
        c = CostModel.calibrated({n: 1.0 for n in range(1, 7)}, {})
        c.observe(1, 1.0)
        for _ in range(5):
            c.observe_draft(1, 0.3)
        return c

    fixed = AdaptiveBudget(5, costs(), alphas=[0.6, 0.45, 0.45, 0.45, 0.45])
    assert _run_budget(fixed, 20)[-5:] == [5] * 5
    old = AdaptiveBudget(5, costs(), alphas=[0.6, 0.45, 0.45, 0.45, 0.45])
    old.estimates = lambda: list(old.alphas)  # type: ignore[method-assign]  # the old pricing
    assert max(_run_budget(old, 20)) <= 2
    # low acceptance still stops drafting (probing once every 8 steps)
    low = AdaptiveBudget(5, costs())
    assert sum(k > 0 for k in _run_budget(low, 40, accept_all=False)[10:]) <= 4


def test_a_noisy_calibration_is_fitted_monotone():
    from specdec.control import CostModel

    costs = CostModel.calibrated({1: 1.0, 4: 1.0, 5: 1.5, 6: 1.6, 7: 1.3, 8: 2.3}, {})
    ratios = [costs.ratio(n) for n in (4, 5, 6, 7, 8)]
    assert ratios == sorted(ratios) and ratios[-1] == 2.3


# -- the draft's default numerics ----------------------------------------------------------------


def test_the_draft_defaults_to_the_fastest_cpu_numerics_and_stays_lossless(
    tiny_pair, tiny_draft_dir, tiny64, tiny_tokenizer_dir, tmp_path_factory
):
    """A draft model on a CPU runs in int4 unless told otherwise (its rounding cannot reach the
    output); a draft int4 cannot pack falls back to int8-dynamic, a float64 target (the
    exactness reference) keeps a float64 draft, and dtype= still wins."""
    from specdec.speculators.draft_model import default_draft_dtype
    from specdec.target.lowbit import DynamicInt8Linear, Int4WeightLinear
    from tests.conftest import build_tiny_model

    def linears(engine) -> set[type]:
        model = engine.speculator.runner.model
        return {type(m) for m in model.modules() if "Linear" in type(m).__name__}

    target, _ = tiny_pair
    assert default_draft_dtype(target) == "int4"
    assert default_draft_dtype(tiny64) == "float64"
    # a 40-wide draft: its 20-wide k/v projections are no multiple of int4's 16-channel packing
    odd = build_tiny_model(
        tmp_path_factory.mktemp("odd_draft"), tiny_tokenizer_dir, seed=3, layers=1, hidden=40
    )
    cases = [
        (target, f"draft:model={tiny_draft_dir}", {Int4WeightLinear}),
        (target, f"draft:model={odd}", {DynamicInt8Linear}),
        (target, f"draft:model={tiny_draft_dir},dtype=float32", None),
        (tiny64, f"draft:model={tiny_draft_dir}", None),
    ]
    for loaded, spec, want in cases:
        engine = SpeculativeEngine.from_pretrained(loaded, speculator=spec)
        got = linears(engine)
        if want is None:  # no low-bit layer at all
            assert not got & {Int4WeightLinear, DynamicInt8Linear}, (spec, got)
        else:
            assert want <= got, (spec, got)
        for prompt in PROMPTS[:2]:
            spec_out = engine.generate(prompt, max_new_tokens=24)
            plain = engine.generate(prompt, max_new_tokens=24, speculate=False)
            assert spec_out.token_ids == plain.token_ids, (spec, prompt)
    draft64 = SpeculativeEngine.from_pretrained(tiny64, speculator=f"draft:model={tiny_draft_dir}")
    assert next(draft64.speculator.runner.model.parameters()).dtype == torch.float64
