"""The adaptive controller (method ``auto``) and the verification cost calibration.

Controller tests drive :class:`Controller` with a fake cost model (fixed T(n) tables) and
scripted acceptance: it must pick the arm with the best expected tokens per second, draft
nothing when speculation cannot pay, and follow acceptance when it changes. ``auto`` itself is
checked end to end on tiny random models: greedy output identical to plain decoding (float64,
so no argmax ties), sampled output exactly the target's distribution (the chi-square test of
test_losslessness), statistics recording the choices, bad configurations rejected.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.control import CostModel
from specdec.control.calibration import (
    CostCalibration,
    cost_calibration_path,
    load_cost_calibration,
    measure_verify_costs,
    save_cost_calibration,
)
from specdec.control.controller import ArmSpec, Choice, Controller, ControllerConfig
from specdec.errors import CheckpointError, ConfigError, UnknownSpeculatorError
from specdec.speculators import PromptLookupSpeculator, Speculator
from specdec.speculators.auto import ArmController
from specdec.speculators.base import DraftContext
from specdec.testing import MarkovSpeculator, MarkovTarget, ScriptedSpeculator, word_tokenizer
from specdec.tree import DraftTree

# -- fakes ----------------------------------------------------------------------------------------


def flat_costs(slope: float = 0.05) -> CostModel:
    """T(n) = 1 + slope (n - 1) for chains and trees alike, never updated."""
    ratios = {n: 1.0 + slope * (n - 1) for n in range(1, 65)}
    return CostModel(frozen=True, chain_ratios=ratios, tree_ratios=ratios)


def chain(k: int) -> DraftTree:
    return DraftTree.chain(1, list(range(10, 10 + k)))


def run(controller: Controller, steps: int, offers, accept) -> list[Choice]:
    """``accept(arm, size) -> accepted tokens`` scripts the target's verdicts."""
    choices = []
    for _ in range(steps):
        choice = controller.choose(offers, cap=5)
        choices.append(choice)
        if choice.arm is not None:
            controller.observe(choice, choice.size, accept(choice.arm, choice.size), choice.size)
    return choices


def counts(choices: list[Choice]) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for c in choices:
        out[c.arm] = out.get(c.arm, 0) + 1
    return out


# -- controller ----------------------------------------------------------------------------------


def test_picks_the_arm_whose_drafts_are_accepted():
    arms = [ArmSpec("good"), ArmSpec("bad")]
    ctl = Controller(arms, flat_costs(), ControllerConfig(max_draft=5))
    offers = {"good": chain(5), "bad": chain(5)}
    choices = run(ctl, 200, offers, lambda arm, k: k if arm == "good" else 0)
    late = counts(choices[50:])
    assert late.get("good", 0) > 0.9 * 150
    assert choices[-1].size == 5  # everything accepted: the whole chain pays


def test_drafts_nothing_when_speculation_cannot_pay():
    """Verification of extra tokens costs as much as a whole step: no acceptance rate below 1
    can pay, so the controller settles on plain decoding and only probes, ever more rarely."""
    arms = [ArmSpec("lookup"), ArmSpec("model", on_demand=True, draft_cost=0.5)]
    ctl = Controller(arms, flat_costs(slope=1.0), ControllerConfig(max_draft=4))
    choices = run(ctl, 400, {"lookup": chain(4)}, lambda arm, k: k // 2)
    late = counts(choices[100:])
    assert late.get(None, 0) > 0.95 * 300
    assert all(c.probe for c in choices[100:] if c.arm is not None)


def test_accepted_probes_that_do_not_pay_back_off():
    """Steep verification (two tokens cost 1.68 steps, as llama.cpp on two AVX2 cores) and a
    draft costing 0.45 of a step: a one-token probe whose token is accepted still loses to
    plain decoding (2 tokens in 2.13 steps), so probes back off as if rejected instead of
    recurring every ``probe_every`` steps."""
    arm = ArmSpec("model", on_demand=True, draft_cost=0.45)
    ctl = Controller([arm], flat_costs(slope=0.68), ControllerConfig(max_draft=4))
    choices = run(ctl, 600, {}, lambda name, k: k)  # every drafted token accepted
    probes = [i for i, c in enumerate(choices) if c.arm is not None]
    assert all(choices[i].probe for i in probes)
    assert len(probes) <= 8, probes  # 8, 16, 32, 64, 128, 128, ...: not one per 8 steps
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 64, gaps


def test_an_arm_that_cannot_pay_even_at_full_acceptance_is_left_alone():
    """Over llama.cpp's measured curve (T(n) = 1 + 0.71 (n - 1) steps) a draft whose tokens
    cost 0.4 of a step loses even if all it drafts is accepted (2 tokens in 2.11 steps at
    best). Once its drafting time is measured, its probes stop for HOPELESS_PROBE_FACTOR times
    max_probe_every steps (each probe of a draft model first reads the whole context); a
    draft measured cheaper is probed on the usual schedule again."""
    from specdec.control.controller import HOPELESS_PROBE_FACTOR

    arm = ArmSpec("model", on_demand=True, draft_cost=0.05)  # the prior thinks it cheap
    ratios = {n: 1.0 + 0.71 * (n - 1) for n in range(1, 65)}
    costs = CostModel(chain_ratios=ratios, tree_ratios=ratios)  # learns drafting time; T(1) = 1
    ctl = Controller([arm], costs, ControllerConfig(max_draft=4))
    unit = 0.4  # measured drafting time per token, in T(1) units
    choices = []
    for _ in range(1100):
        choice = ctl.choose({}, cap=4)
        choices.append(choice)
        if choice.arm is not None:
            ctl.observe_draft_time("model", choice.size, unit * choice.size)
            ctl.observe(choice, choice.size, choice.size, choice.size)  # all accepted
    probes = [i for i, c in enumerate(choices) if c.arm is not None]
    limit = HOPELESS_PROBE_FACTOR * ctl.config.max_probe_every
    assert len(probes) == 2 and probes[1] - probes[0] > limit, probes
    assert ctl._hopeless(arm, 4, 1.0)
    for _ in range(40):  # the draft got cheap (as its next probes would measure): back in play
        ctl.observe_draft_time("model", 1, 0.05)
    assert not ctl._hopeless(arm, 4, 1.0)
    later = [ctl.choose({}, cap=4) for _ in range(3)]
    assert any(c.arm == "model" for c in later)


def kquant_like_costs() -> CostModel:
    """T(n) = 1 + 0.15 (n - 1), about `--dtype kquant`'s measured curve; never updated, so
    one long pass costs 0.163 plain steps a token (T(64) / 64)."""
    ratios = {n: 1.0 + 0.15 * (n - 1) for n in range(1, 65)}
    return CostModel(frozen=True, chain_ratios=ratios, tree_ratios=ratios)


@pytest.mark.parametrize(("prompt", "probed"), [(741, False), (100, True)])
def test_a_draft_is_probed_only_when_its_catch_up_can_pay(prompt, probed):
    """A draft model that has not read the prompt must catch up before its first draft: 741
    tokens at 0.25 x 0.163 plain steps each (30 steps) is more than a quarter of the most it
    could save over 128 tokens (128 - 60 steps at full acceptance), so it is never probed
    (the RAG prompts that sank ``auto`` to 0.28x); a 100-token prompt (4 steps) is."""
    arm = ArmSpec("draft", on_demand=True, draft_cost=0.25)
    ctl = Controller([arm], kquant_like_costs(), ControllerConfig(max_draft=8))
    assert ctl.catch_up_cost(arm, prompt) == pytest.approx(0.25 * (1 + 0.15 * 63) / 64 * prompt)
    chosen = []
    for step in range(40):
        choice = ctl.choose({}, cap=8, remaining=128 - step, pending={"draft": prompt})
        chosen.append(choice.arm)
        if choice.arm is not None:
            break
    assert ("draft" in chosen) is probed, chosen
    # without a remaining count nothing is priced: the old behaviour, probed after 8 steps
    ctl = Controller([arm], kquant_like_costs(), ControllerConfig(max_draft=8))
    assert any(ctl.choose({}, cap=8, pending={"draft": 741}).arm for _ in range(10))


def test_catch_up_is_amortised_over_the_tokens_left():
    """A draft known to be accepted 90% of the time pays with a 300-token gap when 500 tokens
    are left, not when 20 are: the one-off cost is spread over what remains."""
    arm = ArmSpec("draft", on_demand=True, draft_cost=0.25)
    ctl = Controller([arm], kquant_like_costs(), ControllerConfig(max_draft=8, probe_every=64))
    ctl.state["draft"].alphas = [0.9] * 8
    ctl.state["draft"].observed = 10
    assert ctl.choose({}, cap=8, remaining=500, pending={"draft": 300}).arm == "draft"
    assert ctl.choose({}, cap=8, remaining=20, pending={"draft": 300}).arm is None
    assert ctl.choose({}, cap=8, remaining=20, pending={"draft": 0}).arm == "draft"


def test_catch_up_is_priced_over_the_lengths_recent_requests_reached():
    """After short answers, a 300-token catch-up is priced over the 20-odd tokens such an
    answer has left, not over the request's 500-token limit: the draft is not read in;
    requests that ran to their limit count as long ones, and a request already past every
    short one is priced over its limit again."""
    arm = ArmSpec("draft", on_demand=True, draft_cost=0.25)
    ctl = Controller([arm], kquant_like_costs(), ControllerConfig(max_draft=8, probe_every=64))
    ctl.state["draft"].alphas = [0.9] * 8
    ctl.state["draft"].observed = 10

    def choice(generated: int) -> str | None:
        left = ctl.expected_left(generated, 500 - generated)
        return ctl.choose({}, cap=8, remaining=left, pending={"draft": 300}).arm

    assert choice(0) == "draft"  # no history: the limit
    for produced in (18, 25, 22):
        ctl.record_length(produced, limited=False)
    assert ctl.expected_left(0, 500) == 22
    assert choice(0) is None
    assert choice(30) == "draft"  # past all of them: the limit again
    for _ in range(3):
        ctl.record_length(500, limited=True)
    assert ctl.expected_left(0, 500) == 261 and choice(0) == "draft"


def test_the_engine_records_each_requests_length_for_greedy_pricing(tiny64, tiny_draft_dir):
    """``auto`` learns request lengths as requests end (greedy and sampled alike; the limit
    flagged), shares them with its forks, and a sampled request's fresh controller has none."""
    spec = f"auto:arms=[prompt-lookup,draft:model={tiny_draft_dir}]"
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator=spec, num_draft_tokens=4)
    engine.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    engine.generate(PROMPTS[1], max_new_tokens=40, stop=[" "])
    arms = engine.arms
    assert arms is not None
    lengths = list(arms._shared.lengths)
    assert lengths[0] == (12, True)
    assert len(lengths) == 2 and not lengths[1][1] and lengths[1][0] < 40
    assert arms.fork()._shared.lengths is arms._shared.lengths
    sampled = Controller(arms.specs, arms._prior, arms.config)
    assert not sampled.lengths and sampled.expected_left(0, 40) == 40


def test_measured_catch_up_replaces_the_prior_except_when_frozen():
    arm = ArmSpec("draft", on_demand=True, draft_cost=0.25)
    ratios = {n: 1.0 + 0.15 * (n - 1) for n in range(1, 65)}
    live = Controller([arm], CostModel(chain_ratios=ratios), ControllerConfig(max_draft=8))
    prior = live.catch_up_cost(arm, 100)
    live.observe_catch_up("draft", 100, 5.0)  # 50 ms a token: far dearer than the prior
    assert live.catch_up_cost(arm, 100) == pytest.approx(5.0) != pytest.approx(prior)
    frozen = Controller([arm], kquant_like_costs(), ControllerConfig(max_draft=8))
    frozen.observe_catch_up("draft", 100, 5.0)
    assert frozen.state["draft"].catch_up_seconds is None
    assert frozen.catch_up_cost(arm, 100) == pytest.approx(0.25 * (1 + 0.15 * 63) / 64 * 100)


def test_short_catch_ups_do_not_inflate_a_long_prompts_price():
    """Catch-ups of a few tokens after skipped steps cost about one draft forward each; they
    must not make a long prompt's price per token several times what its own pass cost (which
    left the draft untried on every later request), nor a short one's free."""
    arm = ArmSpec("draft", on_demand=True, draft_cost=0.25)
    ctl = Controller([arm], CostModel(chain_ratios={n: 1.0 + 0.15 * (n - 1) for n in range(1, 65)}))
    ctl.observe_draft_time("draft", 4, 4 * 0.012)  # 12 ms a drafted token
    ctl.observe_catch_up("draft", 400, 0.012 + 400 * 0.004)  # a prompt: 4 ms a token
    for _ in range(30):
        ctl.observe_catch_up("draft", 3, 0.0135)  # a few skipped tokens: about one forward
    long, short = ctl.catch_up_cost(arm, 700), ctl.catch_up_cost(arm, 3)
    assert 0.7 * (0.012 + 700 * 0.004) < long < 1.2 * (0.012 + 700 * 0.004)
    assert 0.012 <= short < 0.03


def test_a_draft_model_reports_the_tokens_it_has_not_read(tiny64, tiny_draft_dir):
    """What ``auto`` prices: the prompt before the first draft, nothing once it drafts every
    step, the skipped steps after a gap; measured on a real (tiny) draft model."""
    from specdec.config import SamplingConfig
    from specdec.speculators import build_speculator
    from specdec.speculators.base import DraftContext

    draft = build_speculator(tiny64, f"draft:model={tiny_draft_dir}")
    tokens = list(range(5, 45))
    ctx = DraftContext(tokens, len(tokens), SamplingConfig(), torch.Generator(), remaining=10)
    assert draft.pending_catch_up(ctx) == len(tokens) - 1
    tree = draft.propose(ctx, 3)
    assert draft.catch_up_seconds() > 0
    tokens = tokens + [tree.tokens[1]]
    ctx = DraftContext(tokens, 40, SamplingConfig(), torch.Generator())
    assert draft.pending_catch_up(ctx) == 0
    tokens = tokens + [7, 8, 9, 10]
    ctx = DraftContext(tokens, 40, SamplingConfig(), torch.Generator())
    assert draft.pending_catch_up(ctx) == 4


class _SelfSizing(Speculator):
    """An on-demand chain drafter that stops its chains itself (as ``draft:length=auto``):
    records the budgets it is asked for and drafts the target's own continuation."""

    name = "draft"
    drafts_by_model = True

    def __init__(self, truth: list[int]) -> None:
        self.truth, self.asked = truth, []

    def chain_cap(self, sampling):  # noqa: ANN001, ANN201
        return 12 if sampling.greedy else None

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        self.asked.append(budget)
        n = len(context.tokens)
        return DraftTree.chain(context.tokens[-1], self.truth[n : n + min(budget, 10)])


def test_auto_lets_a_self_sizing_draft_choose_its_length():
    """The controller decides that the draft drafts; the draft, which sees its confidences,
    how far (up to its own cap, past the controller's K of 4)."""
    from specdec.config import SamplingConfig

    truth = list(range(100, 400))
    arm = _SelfSizing(truth)
    ctl = ArmController([arm], num_draft_tokens=4)
    ctl._shared.state["draft"].alphas = [0.95] * 4
    tokens = truth[:20]
    ctx = DraftContext(tokens, 20, SamplingConfig(), torch.Generator(), remaining=200)
    tree = ctl.draft(ctx, budget=500)
    assert ctl.last_choice == "draft" and arm.asked == [12] and tree.num_drafted == 10
    fixed = DraftContext(tokens, 20, SamplingConfig(), torch.Generator(), fixed_length=True)
    ctl.draft(fixed, budget=500)
    assert arm.asked[-1] <= 4  # adaptive=False: the controller's length, exactly


def test_costly_drafter_needs_high_acceptance():
    """An on-demand arm costing 0.7 T(1) per token does not pay at 60% acceptance, a free
    offered one does."""
    arms = [ArmSpec("model", on_demand=True, draft_cost=0.7), ArmSpec("lookup")]
    ctl = Controller(arms, flat_costs(), ControllerConfig(max_draft=4, prior_alpha=0.6))
    choice = ctl.choose({"lookup": chain(4)}, cap=4)
    assert choice.arm == "lookup"
    ctl2 = Controller(arms[:1], flat_costs(), ControllerConfig(max_draft=4, prior_alpha=0.6))
    assert ctl2.choose({}, cap=4).arm is None
    ctl3 = Controller(arms[:1], flat_costs(), ControllerConfig(max_draft=4, prior_alpha=0.98))
    assert ctl3.choose({}, cap=4).arm == "model"


def test_adapts_when_acceptance_changes():
    arms = [ArmSpec("a"), ArmSpec("b")]
    ctl = Controller(arms, flat_costs(), ControllerConfig(max_draft=4))
    offers = {"a": chain(4), "b": chain(4)}
    phase = {"good": "a"}
    choices = run(ctl, 150, offers, lambda arm, k: k if arm == phase["good"] else 0)
    assert counts(choices[100:]).get("a", 0) > 40
    phase["good"] = "b"  # the workload shifts: b's drafts are now the accepted ones
    choices = run(ctl, 300, offers, lambda arm, k: k if arm == phase["good"] else 0)
    assert counts(choices[200:]).get("b", 0) > 85


def test_a_low_estimate_recovers_through_probes():
    arms = [ArmSpec("a")]
    ctl = Controller(arms, flat_costs(slope=0.3), ControllerConfig(max_draft=4))
    state = {"good": False}
    choices = run(ctl, 100, {"a": chain(4)}, lambda arm, k: k if state["good"] else 0)
    assert counts(choices[50:]).get("a", 0) < 10  # mostly plain decoding, a few probes
    state["good"] = True
    choices = run(ctl, 300, {"a": chain(4)}, lambda arm, k: k if state["good"] else 0)
    assert counts(choices[-50:]).get("a", 0) == 50


def test_a_paying_drafter_is_not_lost_after_a_bad_streak():
    """An on-demand tree drafter (EAGLE-like: cheap, first draft accepted 60% of the time, the
    whole tree when it is) pays on average. A long streak of rejections drives its estimate
    below plain decoding and its probe interval to the maximum; once its drafts are accepted
    again, probes (which still fail 40% of the time) must bring it back for good."""
    import random

    rng = random.Random(0)
    arm = ArmSpec("eagle", on_demand=True, tree=True, draft_cost=0.05)
    ctl = Controller([arm], flat_costs(slope=0.05), ControllerConfig(max_draft=4))
    streak = {"bad": True}

    def accept(name: str, size: int) -> int:
        return 0 if streak["bad"] or rng.random() > 0.6 else 3

    def go(steps: int) -> list[Choice]:
        out = []
        for _ in range(steps):
            choice = ctl.choose({}, cap=4)
            out.append(choice)
            if choice.arm is not None:
                ctl.observe(choice, 3, accept(choice.arm, 3), 6)
        return out

    go(300)  # the bad streak: probes fail, their interval grows to the maximum
    streak["bad"] = False
    later = go(600)
    assert counts(later[-200:]).get("eagle", 0) > 150, ctl.state["eagle"]


def test_plain_decoding_is_priced_before_any_plain_step_was_timed():
    """The engine times every pass into a live cost model. A run that has so far only drafted
    (the warm-up, a first request) has timed trees but never a plain pass; pricing plain
    decoding at a default T(1) of one second against trees measured at ~0.1 s made every draft
    look several times faster than plain decoding, so an EAGLE-like arm whose drafts are never
    accepted (its draft model off its training distribution, as on long summarization prompts)
    was run on every step. T(1) must follow from the passes that were timed."""
    ratios = {n: 1.0 + 0.05 * (n - 1) for n in range(1, 65)}
    costs = CostModel.calibrated(ratios, ratios)
    arm = ArmSpec("eagle", on_demand=True, tree=True, draft_cost=0.05)
    ctl = Controller([arm], costs, ControllerConfig(max_draft=4))
    t1 = 0.1  # this machine's plain pass, in seconds

    def go(steps: int, accepted: int) -> list[Choice]:
        """The engine's loop: draft (or not), verify, time the pass into the cost model."""
        out = []
        for i in range(steps):
            choice = ctl.choose({}, cap=4)
            out.append(choice)
            nodes = 2 + i % 5 if choice.arm is not None else 0  # EAGLE sizes vary per step
            if choice.arm is not None:
                ctl.observe_draft_time("eagle", 1, 0.05 * t1)
                ctl.observe(choice, 1, accepted, nodes)
            costs.observe(nodes + 1, t1 * ratios[nodes + 1], tree=nodes > 0)
        return out

    go(20, accepted=1)  # a warm-up where its drafts are accepted: it drafts every step
    choices = go(300, accepted=0)  # then a workload where none is
    late = counts(choices[50:])
    assert late.get(None, 0) > 0.9 * 250, late  # plain decoding, and rare probes
    assert costs.cost(1) == pytest.approx(t1)


def test_cost_unit_follows_load_and_context_while_only_drafting():
    """Every timed pass refreshes T(1), not only plain ones: when passes get slower (a busier
    machine, a longer context) while only drafts are verified, plain decoding's price rises
    with them, and the calibrated shape T(n)/T(1) is kept (one size alone cannot tell a dearer
    size from a slower machine)."""
    costs = CostModel.calibrated({1: 1.0, 5: 1.2}, {5: 1.3})
    costs.observe(1, 0.1)
    for _ in range(3):  # right after a plain pass, a tree's time teaches its ratio
        costs.observe(5, 0.13, tree=True)
    for _ in range(60):
        costs.observe(5, 0.26, tree=True)  # twice the calibrated time: the machine slowed
    assert costs.cost(1) == pytest.approx(0.2, rel=0.01)
    assert costs.ratio(5, tree=True) == pytest.approx(1.3, rel=0.01)
    for _ in range(200):  # with plain steps in between, a size's own ratio is learned
        costs.observe(1, 0.2)
        costs.observe(5, 0.22, tree=True)
    assert costs.ratio(5, tree=True) == pytest.approx(1.1, rel=0.02)
    assert costs.ratio(5) == 1.2  # chains are timed separately


class _Offered(Speculator):
    """A free drafter (offered arm) proposing ``draft(context length)``."""

    def __init__(self, name: str, draft) -> None:
        self.name = name
        self.draft = draft

    def propose(self, context, budget: int) -> DraftTree:
        return DraftTree.chain(context.tokens[-1], self.draft(len(context.tokens))[:budget])


def test_unchosen_free_drafts_are_learned_from_the_committed_tokens():
    """Two free drafters; first only ``a`` drafts what the target says, then only ``b``. The
    controller never picked ``b`` in the first phase (its rare probes failed, so it is probed
    ever more rarely). Its offers cost nothing and the committed tokens tell what verification
    would have accepted of them, so when the workload shifts the controller moves to ``b``
    within a few steps instead of waiting for a probe (up to ``max_probe_every`` steps away)."""
    from specdec.config import SamplingConfig
    from specdec.speculators.base import DraftContext, Feedback
    from specdec.verify.rules import Acceptance

    truth = list(range(1000, 3000))  # the target's greedy output
    phase = {"a": True}
    right = lambda n: truth[n : n + 5]  # noqa: E731
    wrong = lambda n: [7] * 5  # noqa: E731
    arms = [
        _Offered("a", lambda n: right(n) if phase["a"] else wrong(n)),
        _Offered("b", lambda n: wrong(n) if phase["a"] else right(n)),
    ]
    auto = ArmController(arms, config=ControllerConfig(max_draft=5))
    auto.bind_costs(flat_costs(slope=0.3))
    tokens = [truth[0]]

    def go(steps: int) -> list[str | None]:
        out = []
        for _ in range(steps):
            ctx = DraftContext(tokens, 1, SamplingConfig(), torch.Generator())
            tree = auto.draft(ctx, budget=50)
            n = 0
            while n < tree.num_drafted and tree.tokens[n + 1] == truth[len(tokens) + n]:
                n += 1
            committed = tuple(truth[len(tokens) : len(tokens) + n + 1])
            auto.observe(Feedback(tree, Acceptance(tuple(range(n + 1)), committed)))
            tokens.extend(committed)
            out.append(auto.last_choice)
        return out

    assert go(150)[-50:].count("a") > 45
    phase["a"] = False
    later = go(60)
    assert later[10:].count("b") > 45, later


def test_estimates_are_conditioned_on_the_size_of_an_offered_tree():
    """A suffix-cache-like arm: its large trees (long matches) are accepted deep, its small
    ones (short matches) never. The controller learns both and drafts only the confident ones."""

    def tree(n: int) -> DraftTree:
        return DraftTree(tuple(range(n + 1)), (-1, *range(n)))  # a deep path, counted as a tree

    ctl = Controller([ArmSpec("sfx", tree=True)], flat_costs(slope=0.05))
    for i in range(300):
        offer = tree(20) if i % 2 else tree(2)
        choice = ctl.choose({"sfx": offer}, cap=5)
        if choice.arm is not None:
            ctl.observe(choice, max(offer.depths), 12 if offer.num_drafted == 20 else 0)
    assert ctl.choose({"sfx": tree(20)}, cap=5).arm == "sfx"
    small = [ctl.choose({"sfx": tree(2)}, cap=5) for _ in range(20)]
    assert sum(c.arm == "sfx" and not c.probe for c in small) == 0


def test_chains_are_cut_to_the_length_that_pays():
    """First draft right 90%, later ones never: one token is the best chain."""
    ctl = Controller([ArmSpec("a")], flat_costs(slope=0.2), ControllerConfig(max_draft=5))
    ctl.state["a"].alphas = [0.9, 0.05, 0.05, 0.05, 0.05]
    assert ctl.choose({"a": chain(5)}, cap=5).size == 1
    assert ctl.choose({"a": chain(5)}, cap=0).arm is None  # no room left: nothing
    trees = Controller([ArmSpec("la", tree=True)], flat_costs(slope=0.01))
    assert trees.choose({"la": chain(5)}, cap=2).size == 5  # a tree drafter's draft: whole


def test_guardrail_stops_an_adaptive_arm_below_its_static_one():
    arms = [ArmSpec("static", on_demand=True), ArmSpec("adaptive", on_demand=True, guard="static")]
    ctl = Controller(arms, flat_costs(), ControllerConfig(max_draft=3))
    ctl.state["static"].alphas = [0.5] * 5
    ctl.state["adaptive"].alphas = [0.6] * 5
    ctl.state["static"].observed = ctl.state["adaptive"].observed = 1
    assert ctl.choose({}, cap=3).arm == "adaptive"
    ctl.state["adaptive"].alphas = [0.45] + [0.99] * 4  # better later, worse first: blocked
    assert ctl.choose({}, cap=3).arm == "static"
    with pytest.raises(ConfigError, match="guarded"):
        Controller([ArmSpec("x", guard="nope")])


def test_frozen_costs_ignore_timings():
    ctl = Controller([ArmSpec("m", on_demand=True, draft_cost=0.1)], flat_costs())
    ctl.observe_draft_time("m", 4, 100.0)
    assert ctl.state["m"].draft_seconds is None
    live = Controller([ArmSpec("m", on_demand=True)], CostModel(seconds={1: 1.0}))
    live.observe_draft_time("m", 4, 2.0)
    assert live.state["m"].draft_seconds == 0.5


# -- cost model and calibration -------------------------------------------------------------------


def test_cost_model_uses_calibrated_ratios_and_refines_online():
    costs = CostModel.calibrated({1: 1.0, 8: 1.3}, {8: 1.6})
    costs.observe(1, 0.1)
    assert costs.cost(8) == pytest.approx(0.13)
    assert costs.cost(8, tree=True) == pytest.approx(0.16)
    for _ in range(100):  # a measured tree size moves its calibrated ratio to what it costs
        costs.observe(1, 0.1)
        costs.observe(8, 0.2, tree=True)
    assert costs.cost(8, tree=True) == pytest.approx(0.2, rel=0.01)
    assert costs.cost(8) == pytest.approx(0.13, rel=0.01)  # chains are timed separately
    generic = CostModel(seconds={1: 0.1})
    generic.observe(8, 0.3)  # the generic slope is a guess: the first observation replaces it
    assert generic.ratio(8) == pytest.approx(3.0)
    frozen = costs.frozen_prior()
    frozen.observe(1, 5.0)
    assert frozen.cost(8) == pytest.approx(1.3) and frozen.cost(8, tree=True) == 1.6


def test_calibration_is_kept_per_thread_count(tiny64, tmp_path, monkeypatch):
    """A curve measured on 2 threads is not this run's on 1 (verification is bound by
    arithmetic, which threads divide; one step by memory, which they do not)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cal = measure_verify_costs(tiny64, [2], repeats=1)
        assert cal.threads == 2
        two = save_cost_calibration(tiny64, cal)
        assert load_cost_calibration(tiny64) is not None
        torch.set_num_threads(1)
        assert cost_calibration_path(tiny64) != two
        assert load_cost_calibration(tiny64) is None  # measure again for 1 thread
        # a file saved before threads were part of the key is used only on its own count
        legacy = tmp_path / "legacy.json"
        two.rename(legacy)
        from specdec.control.calibration import legacy_cost_calibration_path

        legacy_cost_calibration_path(tiny64).parent.mkdir(parents=True, exist_ok=True)
        legacy.rename(legacy_cost_calibration_path(tiny64))
        assert load_cost_calibration(tiny64) is None
        torch.set_num_threads(2)
        old = load_cost_calibration(tiny64)
        assert old is not None and old.threads == 2
    finally:
        torch.set_num_threads(before)


def test_calibration_measures_saves_and_primes_the_engine(tiny64, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_cost_calibration(tiny64) is None
    passes = []
    cal = measure_verify_costs(
        tiny64, [2, 4], repeats=2, progress=lambda it: passes.extend(it) or passes
    )
    assert len(passes) == 3 * 5  # warm-up + 2 repeats of chains 1, 2, 4 and trees 2, 4
    assert set(cal.chain) == {1, 2, 4} and set(cal.tree) == {1, 2, 4}
    assert cal.ratios()[1] == 1.0 and all(s > 0 for s in cal.tree.values())
    path = save_cost_calibration(tiny64, cal)
    assert path.is_relative_to(tmp_path / "specdec" / "cost")
    loaded = load_cost_calibration(tiny64)
    assert loaded is not None and loaded.ratios(True) == cal.ratios(True)
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    assert engine.cost_model.chain_ratios == cal.ratios(False)
    path.write_text("{not json")  # unreadable: ignored with a warning, the generic prior used
    assert load_cost_calibration(tiny64) is None
    with pytest.raises(ValueError):
        CostCalibration.from_json(json.loads('{"format": "other"}'))
    with pytest.raises(ValueError):
        measure_verify_costs(tiny64, [65])


def test_first_use_calibrates_packs_or_as_told_and_saves_it(tiny64, tmp_path, monkeypatch, caplog):
    """A speculating engine on a model without a calibration measures one once (model packs by
    default, any model with SPECDEC_CALIBRATE=always); plain decoding and 'never' measure
    nothing; a bad value is named and the default kept."""
    from specdec.control import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "FIRST_USE_SIZES", (1, 2, 4, 8))
    SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")  # default: packs only
    assert load_cost_calibration(tiny64) is None
    monkeypatch.setenv("SPECDEC_CALIBRATE", "never")
    SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    assert load_cost_calibration(tiny64) is None
    monkeypatch.setenv("SPECDEC_CALIBRATE", "sometimes")
    with caplog.at_level("WARNING"):
        SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    assert "SPECDEC_CALIBRATE='sometimes' is not one of packs, always, never" in caplog.text
    assert load_cost_calibration(tiny64) is None
    monkeypatch.setenv("SPECDEC_CALIBRATE", "always")
    SpeculativeEngine.from_pretrained(tiny64, speculator="none")  # plain: nothing to price
    assert load_cost_calibration(tiny64) is None
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    saved = load_cost_calibration(tiny64)
    assert saved is not None and set(saved.chain) == {1, 2, 4, 8}
    assert engine.cost_model.chain_ratios == saved.ratios(False)
    # between two timed sizes the price is on the line joining them, not the generic slope
    r4, r8 = engine.cost_model.ratio(4), engine.cost_model.ratio(8)
    assert min(r4, r8) <= engine.cost_model.ratio(6) <= max(r4, r8)
    mtime = cost_calibration_path(tiny64).stat().st_mtime_ns
    SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")  # once only
    assert cost_calibration_path(tiny64).stat().st_mtime_ns == mtime


# -- auto, end to end ----------------------------------------------------------------------------

PROMPTS = [
    "ROMEO: But soft, what light",
    "First Citizen:\nBefore we proceed any further, hear me speak. Speak, speak. Before we",
    "the the the the the the the",
]


@pytest.mark.parametrize(
    "arms", [None, "[prompt-lookup,draft:model=DRAFT]", "[suffix,lookahead,self:layers=exit:2]"]
)
def test_auto_greedy_equals_plain(tiny64, tiny_draft_dir, arms):
    spec = "auto" if arms is None else "auto:arms=" + arms.replace("DRAFT", str(tiny_draft_dir))
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator=spec, num_draft_tokens=4)
    total: dict[str, int] = {}
    for _ in range(2):  # the second pass: the suffix cache drafts earlier answers
        for prompt in PROMPTS:
            plain = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, speculate=False)
            spec = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
            assert spec.token_ids == plain.token_ids, (arms, prompt)
            assert sum(spec.stats.choices.values()) == spec.stats.target_forwards
            for k, v in spec.stats.choices.items():
                total[k] = total.get(k, 0) + v
    assert spec.stats.to_dict()["choices"] == spec.stats.choices
    drafted = {k for k in total if k != "none"}
    assert drafted, total  # something drafted on these repetitive prompts
    assert engine.arms is not None
    if arms is None:  # the training-free ones
        assert set(engine.arms.arms) == {"prompt-lookup", "suffix", "lookahead"}
    else:
        assert len(engine.arms.arms) == len(engine.speculators) == arms.count(",") + 1


def test_auto_with_medusa_reads_features(tiny64, tmp_path):
    """A feature-level arm gets the target's hidden states through auto; output unchanged."""
    from specdec.heads.medusa import MedusaConfig, MedusaHeads

    cfg = tiny64.model.config
    mcfg = MedusaConfig(cfg.hidden_size, cfg.vocab_size, num_heads=2, target=tiny64.identity())
    torch.manual_seed(0)
    MedusaHeads(mcfg).save(tmp_path / "heads")
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=f"auto:arms=[medusa:dir={tmp_path / 'heads'},prompt-lookup]"
    )
    assert engine.target.features is not None or engine.speculators[0].needs_hidden_states
    assert engine.arms is not None and engine.arms.needs_hidden_states
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=30, ignore_eos=True, speculate=False)
        spec = engine.generate(prompt, max_new_tokens=30, ignore_eos=True)
        assert spec.token_ids == plain.token_ids


def test_auto_bad_configurations(tiny64, other_vocab_model_dir):
    def build(spec: str) -> SpeculativeEngine:
        return SpeculativeEngine.from_pretrained(tiny64, speculator=spec)

    with pytest.raises(UnknownSpeculatorError, match="unknown speculator 'nope'"):
        build("auto:arms=suffix+nope")
    with pytest.raises(ConfigError, match="auto cannot choose 'auto'"):
        build("auto:arms=auto")
    with pytest.raises(ConfigError, match="twice"):
        build("auto:arms=suffix+suffix")
    with pytest.raises(ConfigError, match="needs dir="):
        build("auto:arms=medusa")
    with pytest.raises(ConfigError, match="chains only"):  # another tokenizer: through text
        build(f"auto:arms=[suffix,draft:model={other_vocab_model_dir},tree=2x2]")
    with pytest.raises(CheckpointError):
        build(f"auto:arms=[medusa:dir={other_vocab_model_dir}]")


def test_auto_sampling_is_lossless():
    """The chi-square test of test_losslessness, with auto choosing between a Markov draft
    (q carried, on demand) and a scripted deterministic drafter."""
    from tests.test_losslessness import (
        SAMPLES,
        K,
        chi_square_pvalue,
        exact_joint,
        sample_joint,
        tables,
    )

    target_t, draft_t = tables()
    arms = [MarkovSpeculator(draft_t), ScriptedSpeculator({1: [0, 1], 2: [2], 3: [1, 1]})]
    arms[0].name = "draft"  # an on-demand arm: produces q
    auto = ArmController(arms, num_draft_tokens=K, config=ControllerConfig(max_draft=K))
    engine = SpeculativeEngine(
        MarkovTarget(target_t), word_tokenizer(3), arms=auto, num_draft_tokens=K
    )
    counts_ = sample_joint(engine, start=0)
    assert sum(counts_.values()) == SAMPLES
    assert chi_square_pvalue(counts_, exact_joint(target_t, 0)) > 1e-3


def test_auto_sampled_output_depends_on_the_seed_only(tiny64):
    """Timings and other requests' greedy traffic do not change a seeded sampled output (the
    suffix cache is left out: what it learns from other requests changes any method's drafts,
    hence which random numbers are drawn)."""
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator="auto:arms=prompt-lookup+lookahead"
    )
    kw = dict(max_new_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    first = engine.generate(PROMPTS[1], **kw)
    engine.generate(PROMPTS[2], max_new_tokens=30, ignore_eos=True)  # greedy traffic in between
    engine.cost_model.observe(1, 123.0)  # and very different timings
    assert engine.generate(PROMPTS[1], **kw).token_ids == first.token_ids


def test_feature_columns_are_sliced_per_arm():
    class Feat(PromptLookupSpeculator):
        name = "feat"
        needs_hidden_states = True
        feature_layers = (2, -1)

    class Final(PromptLookupSpeculator):
        name = "final"
        needs_hidden_states = True

    auto = ArmController([Final(), Feat()], num_layers=4)
    assert auto.feature_layers == (-1, 2)  # -1 and 4 are the same state: kept once
    feats = torch.cat([torch.full((3, 2), 1.0), torch.full((3, 2), 2.0)], -1)  # [M, 2H]
    from specdec.config import SamplingConfig
    from specdec.speculators import DraftContext

    ctx = DraftContext([1, 2, 3], 3, SamplingConfig(), torch.Generator(), feats)
    assert auto._context_for("final", ctx).features.tolist() == [[1.0, 1.0]] * 3
    assert auto._context_for("feat", ctx).features.tolist() == [[2.0, 2.0, 1.0, 1.0]] * 3
    assert auto._context_for("absent", ctx).features is None


def test_doctests():
    import doctest

    from specdec.bench import methods
    from specdec.control import budget, calibration, controller
    from specdec.speculators import auto

    for module in (budget, calibration, controller, auto, methods):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_calibrate_cost_cli(tiny_model_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from specdec.cli.main import app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ["calibrate", "cost", "--model", str(tiny_model_dir), "--max-nodes", "3"]
    result = CliRunner().invoke(app, [*args, "--repeats", "1", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "saved the verification cost" in result.output
    saved = json.loads(next((tmp_path / "specdec" / "cost").glob("*.json")).read_text())
    assert set(saved["chain_ratio"]) == {"1", "2", "3"} and saved["target"]["hidden_size"] == 64
    bad = CliRunner().invoke(app, ["calibrate", "cost", "--max-nodes", "65"])
    assert bad.exit_code == 2 and "--max-nodes" in bad.output


def test_bench_runs_auto_and_reports_its_choices():
    from specdec.bench.methods import parse_methods
    from specdec.bench.report import choice_table
    from specdec.speculators import parse_spec

    specs = parse_methods("auto:suffix+prompt-lookup,auto")
    assert [(s.label, s.options) for s in specs[1:]] == [
        ("auto:suffix+prompt-lookup", parse_spec("auto:arms=suffix+prompt-lookup")),
        ("auto", parse_spec("auto")),
    ]
    records = [
        {"method": "auto", "group": "qa", "choices": {"suffix": 3, "none": 1}},
        {"method": "auto", "group": "rag", "choices": {"prompt-lookup": 4}},
        {"method": "none", "group": "qa", "choices": None},
    ]
    table = "\n".join(choice_table(records))
    assert "| `auto` | qa | suffix 75%, none 25% |" in table
    assert "| `auto` | overall | prompt-lookup 50%, suffix 38%, none 12% |" in table


def test_report_compares_auto_with_the_best_single_method():
    from specdec.bench.report import auto_vs_best, summaries_by_group

    def rec(method: str, group: str, line: int, tps: float) -> dict:
        return {
            "method": method, "group": group, "line": line, "question_id": line, "repeat": 0,
            "new_tokens": 10, "seconds": 10 / tps, "tokens_per_s": tps, "target_forwards": 5,
            "mean_accepted": 2.0, "drafted_at": [5], "accepted_at": [5], "token_ids": [1],
            "identical": True, "first_diff": None, "draft_fraction": 0.0, "draft_seconds": 0.0,
            "verify_seconds": 1.0, "prefill_seconds": 0.1, "acceptance_by_position": [1.0],
            "finish_reason": "length", "prompt_tokens": 5, "category": group,
        }  # fmt: skip

    records = [
        rec("none", "qa", 1, 10.0), rec("suffix", "qa", 1, 15.0), rec("lookahead", "qa", 1, 12.0),
        rec("auto", "qa", 1, 14.0), rec("hf", "qa", 1, 30.0),
    ]  # fmt: skip
    lines = auto_vs_best(summaries_by_group(records))
    row = next(x for x in lines if x.startswith("| qa "))
    assert "`suffix` | 1.50×" in row and "1.40× (0.93 of best)" in row
    assert auto_vs_best(summaries_by_group(records[:3])) == []
    # several prompts: auto ÷ best per prompt, with a 95% interval and its verdict
    speeds = {"none": 10.0, "suffix": 15.0, "auto": 14.5}
    many = [
        rec(m, "qa", line, v * (1 + 0.04 * (-1) ** line if m == "auto" else 1))
        for line in range(1, 6)
        for m, v in speeds.items()
    ]
    lines = auto_vs_best(summaries_by_group(many), many)
    row = next(x for x in lines if x.startswith("| qa "))
    assert "of best, 0.9" in row and "–1.0" in row and ": within noise)" in row, row
    slower = [r | {"tokens_per_s": 12.0} if r["method"] == "auto" else r for r in many]
    row = next(x for x in auto_vs_best(summaries_by_group(slower), slower) if "| qa " in x)
    assert "0.80 of best, 0.80–0.80: slower" in row, row
