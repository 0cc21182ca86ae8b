"""Drafting is priced per drafted token, without the draft's catch-up on committed context.

A draft model that did not draft for a while must read the tokens it missed before drafting
again. That work grows with the gap, so charging it to the next draft's tokens priced drafting
out of reach exactly when it had stopped: on the real Qwen2.5-Coder pair the adaptive budget
fell to plain decoding although every drafted token was accepted. These tests time a scripted
draft whose catch-up is slow (sleeps dominate, so a loaded machine only makes steps slower,
never reverses the comparison) against a target whose verification has a fixed cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdec import GenerationConfig, SpeculativeEngine, Speculator
from specdec.speculators import DraftContext
from specdec.testing import MarkovTarget, word_tokenizer
from specdec.tree import DraftTree

V = 8
CATCH_UP_PER_TOKEN = 0.02  # seconds per committed token the draft had not read
DRAFT_PER_TOKEN = 0.001
VERIFY = 0.01  # T(1); n nodes cost VERIFY + VERIFY_PER_NODE * n


def table() -> torch.Tensor:
    """A cycle 0 -> 1 -> ... -> V-1 -> 0 with a clear greedy winner per row."""
    t = torch.zeros(V, V)
    for i in range(V):
        t[i, (i + 1) % V] = 5.0
    return t


class TimedTarget(MarkovTarget):
    def verify(self, tree: DraftTree) -> torch.Tensor:
        time.sleep(VERIFY + 0.0005 * len(tree.tokens))
        return super().verify(tree)


class SlowCatchUpDraft(Speculator):
    """Drafts the target's greedy continuation (always accepted), like a draft model: reading
    the tokens committed since its last draft costs CATCH_UP_PER_TOKEN each, beyond the one or
    two every draft reads."""

    name = "slow-catch-up"
    drafts_by_model = True

    def __init__(self, report_catch_up: bool = True) -> None:
        self.report = report_catch_up
        self.seen = 0
        self._catch_up = 0.0

    def reset(self) -> None:
        self.seen = 0

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        tokens = context.tokens
        t0 = time.perf_counter()
        time.sleep(CATCH_UP_PER_TOKEN * max(0, len(tokens) - self.seen - 2))
        self._catch_up = time.perf_counter() - t0
        time.sleep(DRAFT_PER_TOKEN * budget)
        drafts = [(tokens[-1] + 1 + i) % V for i in range(budget)]
        self.seen = len(tokens) + budget - 1
        return DraftTree.chain(tokens[-1], drafts)

    def catch_up_seconds(self) -> float:
        return self._catch_up if self.report else 0.0


def run(speculator: Speculator, prompt: Sequence[int]) -> float:
    engine = SpeculativeEngine(
        TimedTarget(table()), word_tokenizer(V), speculator, num_draft_tokens=5
    )
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    stats = None
    for event in engine.stream_ids(list(prompt), config):
        stats = event.stats
    assert stats is not None and stats.new_tokens == 48
    return stats.mean_accepted


def test_catch_up_is_not_a_per_token_drafting_cost():
    prompt = [i % V for i in range(40)]  # the first draft reads 38 unseen tokens: 0.76 s
    tau = run(SlowCatchUpDraft(), prompt)
    # every draft is accepted and drafting 5 costs 5 ms against T(1) = 10 ms: the budget
    # drafts the full K = 5 from the second step on (tau 6 but for the first steps' estimates)
    assert tau >= 4.0, tau


def test_the_pricing_test_has_power():
    """The same draft, with its catch-up charged to its tokens as before, stops drafting:
    what the test above would catch if the split were lost."""
    prompt = [i % V for i in range(40)]
    tau = run(SlowCatchUpDraft(report_catch_up=False), prompt)
    assert tau < 2.0, tau
