"""``auto``: several speculators, and the controller that picks one per step in the engine's step.

The training-free speculators (prompt lookup, suffix cache, lookahead) are the default arms;
name others with their options in the spec (``auto:arms=[prompt-lookup,suffix,eagle:dir=D]``).
This is not a speculator wrapping others: the engine asks :class:`ArmController` for each
step's draft, and the controller decides which speculator drafts and how much.
Free arms propose first and the controller prices their actual drafts; costly arms are run
only when the controller expects them to pay (see :mod:`specdec.control.controller`).

Each arm keeps its own contract with the engine: it receives ``observe`` feedback for the
steps it drafted (lookahead advances its Jacobi window from it), arms that declare ``watches``
see every step's committed context through ``watch``, the engine calls ``end_request`` and
``reset`` on all of them, and arms that read the target's hidden states get exactly their own
layers, sliced from the union the engine collects.

Offered drafts that were not chosen still teach the controller: once the tokens after them
are committed, the length of each one's path that matches them is exactly what its
verification would have accepted under greedy decoding (and, for these one-hot drafts, has
the same distribution under rejection sampling), so every free arm's estimates follow the
workload every step instead of only when that arm happens to be chosen. Without it an arm
whose estimate dipped (or a chain's deeper positions, never drafted once the chains are cut
short) stays unobserved, and the controller keeps the worse free draft.

Lossless by construction: whichever arm drafts, the engine's acceptance rule verifies the tree
against the target, so greedy output is plain greedy decoding's and sampled output follows the
target's distribution. Sampled requests also stay reproducible for a seed: their controller is
fresh per request and prices drafts with the frozen calibrated prior, never with timings.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec.control.budget import CostModel
from specdec.control.controller import ArmSpec, Choice, Controller, ControllerConfig, size_class
from specdec.errors import ConfigError
from specdec.speculators.base import DraftContext, Feedback, Speculator, build_speculator
from specdec.speculators.spec import (
    SpeculatorOptions,
    option,
    parse_spec,
    register_options,
    speculator_name,
)
from specdec.target import LoadedModel
from specdec.tree import DraftTree

TRAINING_FREE = ("prompt-lookup", "suffix", "lookahead")
# Prior drafting cost in target decode steps T(1), per drafted token for chains and per tree
# for tree drafters (a small draft model costs about a quarter of a step per token, heads a few
# hundredths per tree). Greedy requests replace it with what they measure; sampled requests
# keep it (reproducibility).
DRAFT_COST_PRIOR = {"draft": 0.25, "self": 0.3, "medusa": 0.03, "eagle": 0.05, "osd": 0.03}
DEFAULT_ON_DEMAND_COST = 0.1
MAX_BACKLOG = 256  # rows of deferred ``watch`` features an arm may have waiting (bounds memory)


def arm_spec(speculator: Speculator, guard: str | None = None) -> ArmSpec:
    """How the controller treats ``speculator``: drafters that run a model (they produce q or
    read hidden states) are decided before drafting; the rest propose first."""
    name = speculator.name
    on_demand = bool(
        speculator.drafts_by_model
        or speculator.produces_q
        or speculator.needs_hidden_states
        or name in DRAFT_COST_PRIOR
    )
    cost = DRAFT_COST_PRIOR.get(name, DEFAULT_ON_DEMAND_COST) if on_demand else 0.0
    return ArmSpec(name, on_demand, bool(speculator.drafts_trees), cost, guard)


def _layer_key(layer: int, num_layers: int) -> int:
    """Hidden-state indices as the model sees them (-1 and L both mean the final state)."""
    return layer % (num_layers + 1)


class ArmController:
    """Chooses, each step, which of several speculators drafts and how much; see the module
    doc. The engine calls :meth:`draft` where it would call one speculator's ``propose``, and
    :meth:`observe` with the verification's feedback; ``last_choice`` names the arm whose draft
    was verified last (``"none"``: no draft)."""

    def __init__(
        self,
        arms: Sequence[Speculator],
        *,
        num_draft_tokens: int = 5,
        num_layers: int = 0,
        guards: dict[str, str] | None = None,
        config: ControllerConfig | None = None,
    ) -> None:
        if not arms:
            raise ConfigError("method auto needs at least one speculator")
        self.arms = {a.name: a for a in arms}
        if len(self.arms) != len(arms):
            raise ConfigError("method auto was given the same speculator twice")
        guards = guards or {}
        self.specs = [arm_spec(a, guards.get(a.name)) for a in arms]
        self.config = config or ControllerConfig(max_draft=num_draft_tokens)
        self.needs_hidden_states = any(a.needs_hidden_states for a in arms)
        layers: list[int] = []
        self._columns: dict[str, list[int]] = {}
        for a in arms:
            if a.needs_hidden_states:
                for layer in a.feature_layers:
                    if _layer_key(layer, num_layers) not in [
                        _layer_key(x, num_layers) for x in layers
                    ]:
                        layers.append(layer)
        keys = [_layer_key(x, num_layers) for x in layers]
        for a in arms:
            if a.needs_hidden_states:
                own = a.feature_layers
                self._columns[a.name] = [keys.index(_layer_key(x, num_layers)) for x in own]
        self.feature_layers = tuple(layers) or (-1,)
        self._shared = Controller(self.specs, CostModel(), self.config)
        self._prior = CostModel.prior()
        self._active: Controller = self._shared
        self._choice = Choice(None)
        self._tree: DraftTree | None = None
        self._fresh = True
        self.last_choice: str | None = None
        self._unchosen: list[_Unchosen] = []
        self._backlog: dict[str, list[torch.Tensor]] = {}  # deferred watch rows, per arm
        self._backlog_end: dict[str, int] = {}  # the position the backlog's rows reach
        self._catch_up_seconds = 0.0

    def bind_costs(self, costs: CostModel) -> None:
        """Price drafts with ``costs`` (the engine's: calibrated, refined from every timed
        step) for greedy requests, and with its frozen prior for sampled ones."""
        self._shared.costs = costs
        self._prior = costs.frozen_prior()

    @property
    def speculators(self) -> tuple[Speculator, ...]:
        return tuple(self.arms.values())

    def reset(self) -> None:
        """A new request: per-request choices go; the greedy controller's estimates stay."""
        self._active = self._shared
        self._fresh = True
        self._choice, self._tree, self.last_choice = Choice(None), None, None
        self._unchosen = []
        self._backlog, self._backlog_end = {}, {}

    def end_request(self, produced: int, limited: bool) -> None:
        """A request ended after producing ``produced`` tokens (``limited``: at its limit); its
        length joins the history that prices the next requests' catch-ups. The greedy
        controller keeps it (shared by forks); sampled requests never read it."""
        self._shared.record_length(produced, limited)

    def fork(self) -> ArmController:
        """A controller for one more concurrent request (batched decoding): its own arm
        instances (:meth:`Speculator.fork`) and per-request state; the greedy controller's
        estimates and the bound costs stay shared, as they are across requests."""
        clone = copy.copy(self)
        clone.arms = {name: arm.fork() for name, arm in self.arms.items()}
        clone.reset()
        return clone

    def choice_counts(self) -> dict[str, int]:
        """Steps each arm drafted, over this speculator's life (greedy requests)."""
        return self._shared.counts()

    # -- drafting -------------------------------------------------------------------------------
    def _context_for(self, name: str, context: DraftContext) -> DraftContext:
        cols = self._columns.get(name)
        if cols is None or context.features is None:
            return replace(context, features=None) if context.features is not None else context
        if len(cols) == len(self.feature_layers) and cols == sorted(cols):
            return context
        h = context.features.shape[-1] // len(self.feature_layers)
        parts = [context.features[:, c * h : (c + 1) * h] for c in cols]
        return replace(context, features=torch.cat(parts, -1) if len(parts) > 1 else parts[0])

    def _watch(self, name: str, arm: Speculator, context: DraftContext) -> None:
        """Hand ``arm`` this step's committed tokens and states. An arm whose ``watch`` only
        extends its drafter's cache (``watch_batches``: EAGLE) gets them in one batch just
        before it drafts (or once ``MAX_BACKLOG`` rows wait): a few milliseconds per step for
        a drafter the controller may not pick for many steps would tax every step, which no
        arm's price shows, and one pass over many rows costs little more than over one."""
        own = self._context_for(name, context)
        if not arm.watch_batches:
            arm.watch(own)
            return
        backlog = self._backlog.setdefault(name, [])
        if own.features is not None:  # [M, H]: positions root-M .. root-1
            start = len(own.tokens) - 1 - len(own.features)
            if self._backlog_end.get(name) != start:  # a step without features: a gap
                backlog.clear()  # rows before it would be absorbed at the wrong positions
            backlog.append(own.features)
            self._backlog_end[name] = len(own.tokens) - 1
        if sum(len(f) for f in backlog) >= MAX_BACKLOG:
            self._catch_up(name, own)
            arm.watch(own)

    def _catch_up(self, name: str, context: DraftContext) -> None:
        """Absorb the rows ``name`` deferred before this step's (oldest first); clears them.
        Untimed: that backlog is the sunk cost of steps the arm skipped (already cheaper than
        watching each), not a cost of the draft it is about to make, so charging it to its
        drafting time would overprice the arm after every gap."""
        backlog = self._backlog.pop(name, [])
        end = self._backlog_end.pop(name, None)
        if end == len(context.tokens) - 1 and backlog:  # the last rows are this step's:
            end -= len(backlog.pop())  # the draft absorbs them itself (and is timed)
        if not backlog or end is None:
            return
        rows = torch.cat(backlog)  # [R, H]: positions end-R .. end-1
        earlier = replace(context, tokens=context.tokens[: end + 1], features=rows)
        self.arms[name].watch(earlier)

    def _propose(self, name: str, context: DraftContext, budget: int) -> tuple[DraftTree, float]:
        """Draft with ``name``; the seconds are its drafting time (after any deferred catch-up)."""
        own = self._context_for(name, context)
        self._catch_up(name, own)
        t0 = time.perf_counter()
        arm = self.arms[name]
        tree = arm.propose(own, budget)
        self._catch_up_seconds = arm.catch_up_seconds()
        return tree, max(0.0, time.perf_counter() - t0 - self._catch_up_seconds)

    def _own_cap(self, spec: ArmSpec, context: DraftContext) -> int | None:
        """The longest chain of an arm that stops its chains itself (a draft model's
        ``length=auto``: it sees each token's confidence), asked for instead of the
        controller's length: the controller decides whether the arm drafts, the arm how far.
        Why: the controller sizes chains from per-position averages, so it asks a confident
        draft for fewer tokens than the draft, stopping when unsure, would give (the Qwen pair
        on code: ``docs/results.md``)."""
        if spec.tree or context.fixed_length:
            return None
        return self.arms[spec.name].chain_cap(context.sampling)

    def catch_up_seconds(self) -> float:
        """The catch-up time of the last on-demand draft (see Speculator.catch_up_seconds)."""
        return self._catch_up_seconds

    def draft(self, context: DraftContext, budget: int) -> DraftTree:
        """This step's draft: from the arm the controller expects to pay best, or none."""
        self._catch_up_seconds = 0.0
        if self._fresh:
            # greedy: one controller learns across requests; sampled: a fresh one on the
            # frozen prior, so the output depends on the seed alone
            greedy = context.sampling.greedy
            self._active = (
                self._shared if greedy else Controller(self.specs, self._prior, self.config)
            )
            self._fresh = False
        controller = self._active
        for name, arm in self.arms.items():
            if arm.watches:  # learners see every step's committed tokens and states
                self._watch(name, arm, context)
        self._learn_from_unchosen(controller, context.tokens)
        root = context.tokens[-1]
        chain_cap = min(budget, self.config.max_draft)
        offers: dict[str, DraftTree] = {}
        for spec in self.specs:
            if not spec.on_demand and budget > 0:
                tree, seconds = self._propose(spec.name, context, budget)
                offers[spec.name] = tree
                controller.observe_draft_time(spec.name, max(1, tree.num_drafted), seconds)
        pending = {
            spec.name: self.arms[spec.name].pending_catch_up(context)
            for spec in self.specs
            if spec.on_demand
        }
        remaining = context.remaining
        if remaining is not None:  # what this request is expected to have left, from past ones
            generated = len(context.tokens) - context.prompt_len
            remaining = controller.expected_left(generated, remaining)
        choice = controller.choose(offers, chain_cap, remaining=remaining, pending=pending)
        tree = DraftTree.root_only(root)
        if choice.arm is not None:
            spec = next(s for s in self.specs if s.name == choice.arm)
            if spec.on_demand:
                ask = (
                    budget
                    if spec.tree
                    else min(self._own_cap(spec, context) or choice.size, budget)
                )
                tree, seconds = self._propose(spec.name, context, ask)
                controller.observe_draft_time(
                    spec.name, 1 if spec.tree else max(1, tree.num_drafted), seconds
                )
                controller.observe_catch_up(
                    spec.name, pending.get(spec.name, 0), self._catch_up_seconds
                )
            else:
                tree = offers[spec.name]
                if not spec.tree and tree.num_drafted > choice.size:
                    tree = _cut_chain(tree, choice.size)
        if tree.num_drafted == 0:
            choice = Choice(None)
        for spec in self.specs:
            offer = offers.get(spec.name)
            if spec.name != choice.arm and offer is not None and offer.num_drafted > 0:
                self._unchosen.append(self._pending(spec, offer, len(context.tokens)))
        self._choice, self._tree = choice, tree
        self.last_choice = choice.arm or "none"
        return tree

    def _pending(self, spec: ArmSpec, offer: DraftTree, start: int) -> _Unchosen:
        """An unchosen offer as it would have been priced: a chain cut to K (the controller
        never asks for more), a tree whole, in its confidence class."""
        if offer.is_chain and not spec.tree:
            offer = _cut_chain(offer, min(offer.num_drafted, self.config.max_draft))
            return _Unchosen(start, Choice(spec.name, offer.num_drafted), offer)
        return _Unchosen(
            start, Choice(spec.name, offer.num_drafted, bucket=size_class(offer)), offer
        )

    def _learn_from_unchosen(self, controller: Controller, tokens: list[int]) -> None:
        """Score the unchosen offers whose outcome the committed tokens now decide."""
        waiting: list[_Unchosen] = []
        for u in self._unchosen:
            if u.start > len(tokens):  # a new request without reset(): stale
                continue
            accepted = matched_depth(u.tree, tokens[u.start :])
            if accepted is None:
                waiting.append(u)
                continue
            depth = max(u.tree.depths)
            controller.observe(u.choice, depth, accepted, u.tree.num_drafted)
        self._unchosen = waiting

    def observe(self, feedback: Feedback) -> None:
        choice, tree = self._choice, self._tree
        self._choice, self._tree = Choice(None), None
        if choice.arm is None or tree is None or feedback.tree is not tree:
            return
        self.arms[choice.arm].observe(feedback)
        depth = max(tree.depths)
        self._active.observe(choice, depth, feedback.acceptance.num_accepted, tree.num_drafted)


@dataclass(frozen=True)
class _Unchosen:
    """An offered draft the controller passed over, waiting for the tokens that decide it."""

    start: int  # context length when it was offered: tokens[start:] follow its root
    choice: Choice
    tree: DraftTree


def matched_depth(tree: DraftTree, continuation: Sequence[int]) -> int | None:
    """How many of ``tree``'s drafts greedy verification accepts when the target's tokens
    after its root are ``continuation`` (the deepest matching path); ``None`` while that
    still depends on tokens not yet known.

    >>> t = DraftTree((9, 1, 2, 3), (-1, 0, 1, 0))  # 9 -> 1 -> 2, and 9 -> 3
    >>> matched_depth(t, [1, 2, 5]), matched_depth(t, [3]), matched_depth(t, [4])
    (2, 1, 0)
    >>> matched_depth(t, [1]) is None  # does 2 follow? not known yet
    True
    """
    children: dict[int, list[int]] = {}
    for i in range(1, len(tree.tokens)):
        children.setdefault(tree.parents[i], []).append(i)
    node, depth = 0, 0
    while children.get(node):
        if depth >= len(continuation):
            return None
        nxt = [c for c in children[node] if tree.tokens[c] == continuation[depth]]
        if not nxt:
            return depth
        node, depth = nxt[0], depth + 1
    return depth


def _cut_chain(tree: DraftTree, k: int) -> DraftTree:
    """The first ``k`` drafts of a chain (q rows cut alike)."""
    probs = None if tree.draft_probs is None else tree.draft_probs[: k + 1]
    return DraftTree.chain(tree.tokens[0], list(tree.tokens[1 : k + 1]), probs)


def _training_free() -> tuple[SpeculatorOptions, ...]:
    return tuple(parse_spec(n) for n in TRAINING_FREE)


@dataclass(frozen=True, kw_only=True)
class AutoOptions(SpeculatorOptions):
    """The speculators ``auto`` chooses among, each a spec with its own options."""

    primary = "arms"
    arms: tuple[SpeculatorOptions, ...] = option(
        (),
        help="speculators to choose among: a+b, or [a,b:key=value] with options (default: "
        "prompt-lookup+suffix+lookahead)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [speculator_name(a) for a in self.arms]
        for n in names:
            if n in ("auto", "none"):
                raise ConfigError(f"auto cannot choose {n!r}: name speculators that draft")
        if len(set(names)) != len(names):
            raise ConfigError(f"auto lists a speculator twice: {'+'.join(names)}")

    def arm_options(self) -> tuple[SpeculatorOptions, ...]:
        """The arms, or the training-free ones by default.

        >>> [speculator_name(a) for a in AutoOptions().arm_options()]
        ['prompt-lookup', 'suffix', 'lookahead']
        """
        return self.arms or _training_free()


def build_arm_controller(
    target: LoadedModel, options: AutoOptions, num_draft_tokens: int
) -> ArmController:
    """The controller over ``options``' arms, each built from its own options."""
    arms = [build_speculator(target, a) for a in options.arm_options()]
    names = {a.name for a in arms}
    num_layers = int(target.config.num_hidden_layers)
    # the speed floor: the online learner must beat the static heads it started from
    guards = {"osd": "medusa"} if {"osd", "medusa"} <= names else {}
    k = options.k or num_draft_tokens
    return ArmController(arms, num_draft_tokens=k, num_layers=num_layers, guards=guards)


register_options(
    "auto",
    AutoOptions,
    None,
    summary="a controller picks, per step, which speculator drafts and how much (ATLAS-style)",
)
