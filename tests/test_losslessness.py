"""Speculative sampling reproduces the target's distribution exactly.

Setup: a table-driven Markov target p and a clearly different Markov draft q over 3 tokens,
temperature 0.8 and top-p 0.9 active (they shape p and q alike). Each request drafts K = 3 tokens
per step and generates 4 tokens; the empirical joint distribution of those 4 tokens over many
seeded requests is compared with the exact joint (a product of shaped Markov transitions) by a
chi-square test (cells with expected count < 5 pooled). With 6,000 samples the test rejects at
significance 1e-3, so a correct rule fails it once in a thousand runs; the seeds are fixed, so it
is deterministic. Power: the same test must reject rules known to be wrong.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec import GenerationConfig, SamplingConfig, SpeculativeEngine, Speculator
from specdec.testing import MarkovSpeculator, MarkovTarget, ScriptedSpeculator, word_tokenizer
from specdec.tree import DraftTree
from specdec.verify import Acceptance, RejectionSamplingRule, probs_from_logits, sample

V, K, N_NEW, SAMPLES, ALPHA = 3, 3, 4, 6_000, 1e-3
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.9)


def tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    target = torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5
    draft = torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5
    return target, draft


def exact_joint(target: torch.Tensor, start: int) -> dict[tuple[int, ...], float]:
    p = probs_from_logits(target, SAMPLING)  # [V, V], row = previous token
    joint = {}
    for seq in itertools.product(range(V), repeat=N_NEW):
        prob, prev = 1.0, start
        for t in seq:
            prob *= float(p[prev, t])
            prev = t
        joint[seq] = prob
    return joint


def sample_joint(engine: SpeculativeEngine, start: int) -> Counter:
    counts: Counter = Counter()
    for seed in range(SAMPLES):
        config = GenerationConfig(
            max_new_tokens=N_NEW,
            sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=seed),
        )
        ids: list[int] = []
        for event in engine.stream_ids([start], config):
            ids.extend(event.token_ids)
        counts[tuple(ids)] += 1
    return counts


def chi_square_pvalue(
    counts: Counter, joint: dict[tuple[int, ...], float], samples: int = SAMPLES
) -> float:
    """Chi-square of sampled sequences against their exact law (cells under 5 pooled)."""
    assert sum(counts.values()) == samples
    impossible = sum(c for seq, c in counts.items() if joint.get(seq, 0.0) == 0.0)
    if impossible:
        return 0.0  # a sequence the target can never produce
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for seq, prob in joint.items():
        if prob == 0.0:
            continue
        e = prob * samples
        if e < 5:
            pool_o += counts.get(seq, 0)
            pool_e += e
        else:
            observed.append(counts.get(seq, 0))
            expected.append(e)
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    total = sum(expected)
    expected = [e * samples / total for e in expected]
    return float(chisquare(observed, expected).pvalue)


class AlwaysAcceptRule:
    """Wrong on purpose: keeps every draft, so output follows q, not p."""

    lossless = False

    def accept(self, tree, logits, sampling, generator):
        p_last = probs_from_logits(logits[-1:], sampling)[0]
        path = tuple(range(len(tree)))
        return Acceptance(path, (*tree.tokens[1:], sample(p_last, generator)))


class ResampleFromPRule(RejectionSamplingRule):
    """Wrong on purpose: on rejection samples from p instead of norm(max(p - q, 0))."""

    lossless = False

    def accept(self, tree, logits, sampling, generator):
        p_all = probs_from_logits(logits, sampling)
        q_all = tree.draft_probs
        accepted, node = [], 0
        for child in range(1, len(tree)):
            x = tree.tokens[child]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(q_all[child][x]) < float(p_all[node][x]):
                accepted.append(x)
                node = child
                continue
            break
        token = sample(p_all[node], generator)
        return Acceptance(tuple(range(node + 1)), (*accepted, token))


def make_engine(rule=None, speculator=None) -> SpeculativeEngine:
    """The Markov target with K fixed drafts per step (default: the Markov draft q)."""
    target, draft = tables()
    return SpeculativeEngine(
        MarkovTarget(target),
        word_tokenizer(V),
        speculator or MarkovSpeculator(draft),
        num_draft_tokens=K,
        acceptance_rule=rule,
        adaptive=False,
    )


def lossless_pvalue(engine: SpeculativeEngine) -> float:
    target, _ = tables()
    return chi_square_pvalue(sample_joint(engine, start=0), exact_joint(target, 0))


def test_draft_differs_clearly_from_target():
    target, draft = tables()
    p = probs_from_logits(target, SAMPLING)
    q = probs_from_logits(draft, SAMPLING)
    assert float(0.5 * (p - q).abs().sum(-1).max()) > 0.3  # total variation per row


def test_speculative_sampling_matches_target_distribution():
    engine = make_engine()
    pvalue = lossless_pvalue(engine)
    assert pvalue > ALPHA, f"speculative sampling departs from p (chi-square p = {pvalue:.2e})"
    # the test exercised multi-token acceptance, not only first-draft rejections
    assert engine.target.forwards < SAMPLES * N_NEW * 0.8


@pytest.mark.parametrize("rule", [AlwaysAcceptRule(), ResampleFromPRule()])
def test_the_test_has_power_against_wrong_rules(rule):
    pvalue = lossless_pvalue(make_engine(rule))
    assert pvalue < ALPHA, f"{type(rule).__name__} went undetected (p = {pvalue:.2e})"


def test_deterministic_drafts_are_lossless_under_sampling():
    """Prompt-lookup-style drafts (q one-hot) through the same rule and the same test."""
    # Always draft the chain 1, 2, 1 whatever the context: often wrong, sometimes right.
    script = {n: [1, 2, 1] for n in range(1, N_NEW + 2)}
    pvalue = lossless_pvalue(make_engine(speculator=ScriptedSpeculator(script)))
    assert pvalue > ALPHA, f"one-hot drafts depart from p (chi-square p = {pvalue:.2e})"


@pytest.mark.slow(threads=1)
def test_tree_with_sibling_drafts_is_lossless():
    """Two independent draft chains from the same root, verified as one tree."""
    _, draft = tables()

    class TwoChains(MarkovSpeculator):
        def propose(self, context, budget):
            a = super().propose(context, budget)
            b = super().propose(context, budget)
            n = len(a)
            tokens = a.tokens + b.tokens[1:]
            parents = a.parents + tuple(p + n - 1 if p > 0 else 0 for p in b.parents[1:])
            probs = torch.cat([a.draft_probs, b.draft_probs[1:]])
            return DraftTree(tokens, parents, probs)

    pvalue = lossless_pvalue(make_engine(speculator=TwoChains(draft)))
    assert pvalue > ALPHA, f"tree verification departs from p (chi-square p = {pvalue:.2e})"


class RankedTreeSpeculator(Speculator):
    """Deterministic Medusa-style trees: depth d's candidates are the draft table's ranking
    after the root token, rotated by d, laid over a topology that branches at depths 1 and 2."""

    name = "ranked-tree"
    produces_q = False
    needs_hidden_states = False
    drafts_trees = True
    TOPOLOGY = ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 0, 1))

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def propose(self, context, budget):
        from specdec.tree.topology import tree_from_topology

        root = context.tokens[-1]
        ranked = torch.argsort(self.table[root], descending=True).tolist()
        candidates = [ranked[d:] + ranked[:d] for d in range(3)]
        return tree_from_topology(root, self.TOPOLOGY, candidates, budget)

    def observe(self, feedback):
        pass

    def reset(self):
        pass


class IgnoreRejectedSiblingsRule(RejectionSamplingRule):
    """Wrong on purpose: tries deterministic siblings with probability p(x) each but never
    removes a rejected sibling from p, so drafted tokens are over-represented."""

    lossless = False

    def accept(self, tree, logits, sampling, generator):
        p_all = probs_from_logits(logits, sampling)
        node, path = 0, [0]
        while True:
            p = p_all[node]
            nxt = None
            for child in tree.children[node]:
                u = float(torch.rand((), generator=generator, dtype=torch.float64))
                if u < float(p[tree.tokens[child]]):
                    nxt = child
                    break
            if nxt is None:
                token = sample(p, generator)
                return Acceptance(tuple(path), (*[tree.tokens[i] for i in path[1:]], token))
            node = nxt
            path.append(node)


@pytest.mark.slow(threads=1)
def test_branching_tree_at_several_depths_is_lossless_and_the_test_has_power():
    """Deterministic trees (q one-hot, distinct siblings) branching at depths 1 and 2, verified
    by multi-draft rejection sampling, reproduce p; a rule that forgets rejected siblings is
    caught by the same test."""
    _, draft = tables()
    spec = RankedTreeSpeculator(draft)
    engine = make_engine(speculator=spec)
    pvalue = lossless_pvalue(engine)
    assert pvalue > ALPHA, f"tree verification departs from p (chi-square p = {pvalue:.2e})"
    assert engine.target.forwards < SAMPLES * N_NEW * 0.8  # multi-token acceptance happened
    wrong = lossless_pvalue(make_engine(rule=IgnoreRejectedSiblingsRule(), speculator=spec))
    assert wrong < ALPHA, f"a wrong tree rule went undetected (p = {wrong:.2e})"
