"""The ATLAS-style controller: which speculator drafts this step, and how much.

Each step the controller compares, for every configured speculator ("arm"), the expected
committed tokens per second of drafting with it,

    rate(arm, k) = E[tokens | arm, k] / (drafting time(arm, k) + T(nodes(k) + 1)),

with plain decoding, ``1 / T(1)``, and takes the best; when no arm beats plain decoding it
drafts nothing, so a workload where nothing pays runs at plain decoding's speed (plus the
controller's microseconds). E[tokens] comes from online per-arm, per-depth acceptance
estimates: ``alphas[d]`` estimates P(draft d+1 accepted | drafts 1..d accepted), an
exponential moving average starting from a prior, kept separately per confidence class of an
offered tree (its size: :func:`size_class`), exactly as :class:`AdaptiveBudget` does for
one speculator (:func:`expected_tokens`). T(n) is the shared :class:`CostModel` (calibrated by
``specdec calibrate cost``, refined online).

Arms come in two kinds:

* **offered** (free drafters: prompt lookup, suffix cache, lookahead): they have already
  proposed this step's draft (microseconds), so the controller prices the actual draft; an
  empty draft is no option, and a chain speculator's draft can be cut to its best length (a
  tree speculator's draft is taken whole: lookahead reads its own tree back). Drafting time
  is spent.
* **on demand** (costly drafters: draft model, self-speculation, Medusa, EAGLE, the online
  learner): the controller decides from the estimates alone whether to run them and, for
  chains, how many tokens to ask for, charging their measured drafting time.

Exploration: an arm that is available but not chosen is probed (one token, or its tree) after
``probe_every`` steps, the interval doubling after each failed probe (one that did not beat
plain decoding's rate) up to ``max_probe_every``, so a low estimate can recover without costing
much when it should not; an on-demand arm that could not beat plain decoding even if all it
drafted were accepted is probed only every ``HOPELESS_PROBE_FACTOR * max_probe_every`` steps
(:meth:`Controller._hopeless`). Guardrail (ATLAS's speed floor): an arm with a ``guard`` (an
adaptive speculator and the static one it must beat) is not chosen while its first-position
acceptance is below the guard's; it is still probed.

Catch-up: a draft model that has not drafted for a while must first read the committed tokens
it has not seen (at a request's start, the whole prompt: seconds for a RAG prompt on a CPU).
That is paid once, not per drafted token, so it is priced against the tokens the request has
left: the arm's rate becomes ``R / (R / rate + C)`` for ``R`` remaining tokens and catch-up
``C`` (measured per token read, or before that the draft's per-token cost times the target's
per-token cost of a long pass, :meth:`CostModel.prefill_ratio`). A probe that needs a catch-up
is made only when ``C`` is at most ``EXPLORE_SHARE`` of what the arm could save over those
``R`` tokens if everything it drafted were accepted: a short prompt is worth the look, a
741-token one is not when 128 tokens are left (:meth:`Controller._worth_exploring`).

How many tokens are left is not known in advance: a request may end (its end-of-sequence token)
long before its limit. A greedy controller keeps the lengths of the last ``LENGTH_HISTORY``
requests and prices a catch-up over the tokens expected to be left, the mean over those recent
requests that ran past this one's current length of what they had left from there (one that
ran to its limit counts as reaching this one's); where none did, or with no history (sampled
requests), over the tokens the limit leaves. Why: priced over a 128-token limit, reading the
prompt looked cheap to the draft model in front of 15-30-token answers (translation, short
questions), where it then cost more than the draft saved (experiments/auto/).

Every decision is a function of acceptance outcomes and the cost model alone; with a frozen
cost model (sampled requests) and fresh estimates it is reproducible for a given seed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specdec.control.budget import CostModel, expected_tokens
from specdec.errors import ConfigError
from specdec.tree import DraftTree

HOPELESS_PROBE_FACTOR = 8  # an arm that cannot pay even at full acceptance: probes this rarer
EXPLORE_SHARE = 0.25  # a probe may spend this share of the arm's best-case saving on catch-up
LENGTH_HISTORY = 32  # recent requests whose lengths price a catch-up (see the module doc)
CATCH_UP_MEMORY = 64  # catch-up tokens read per decay step of the measured catch-up cost


def size_class(tree: DraftTree) -> int:
    """The confidence class of an offered tree: model-free tree drafters size their trees by
    their confidence (the suffix cache drafts about one node per matched token, lookahead adds
    the n-grams it found), so a large tree is a confident one and gets estimates of its own.

    >>> [size_class(DraftTree.chain(0, [1] * n)) for n in (1, 3, 4, 15, 16)]
    [0, 0, 1, 1, 2]
    """
    n = tree.num_drafted
    return 0 if n < 4 else 1 if n < 16 else 2


@dataclass(frozen=True)
class ArmSpec:
    """One speculator as the controller sees it.

    ``on_demand``: drafting costs enough that it must be decided before drafting (see module
    doc). ``tree``: drafts a tree whose size the speculator chooses (``nodes`` is then the
    running estimate of its size) instead of a chain of the controller's length.
    ``draft_cost``: prior drafting time, in units of one target decode step T(1), per drafted
    token for chains and per step for trees; what sampled requests use, and the start for
    greedy ones until measured. ``guard``: the arm this one must beat to be chosen.
    """

    name: str
    on_demand: bool = False
    tree: bool = False
    draft_cost: float = 0.0
    guard: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name == "none":
            raise ConfigError(f"bad arm name {self.name!r}")
        if self.draft_cost < 0:
            raise ConfigError(f"arm {self.name}: draft_cost must be >= 0")


@dataclass(frozen=True)
class ControllerConfig:
    """``max_draft``: the longest chain asked for (K); ``prior_alpha``: acceptance assumed
    before anything is observed; ``decay``: weight of the old estimate per observation."""

    max_draft: int = 5
    prior_alpha: float = 0.5
    decay: float = 0.85
    probe_every: int = 8
    max_probe_every: int = 128
    default_tree_nodes: int = 8

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ConfigError(f"max_draft must be >= 1, got {self.max_draft}")
        if not 0.0 <= self.prior_alpha <= 1.0 or not 0.0 <= self.decay < 1.0:
            raise ConfigError("prior_alpha must be in [0, 1] and decay in [0, 1)")
        if not 1 <= self.probe_every <= self.max_probe_every:
            raise ConfigError("need 1 <= probe_every <= max_probe_every")


@dataclass(frozen=True)
class Choice:
    """What to draft this step: ``arm`` (``None`` = nothing) and ``size``, the number of
    chain tokens to keep or ask for (trees: their own size). ``rate``: expected tokens per
    unit of time; ``probe``: chosen to explore rather than on its estimate."""

    arm: str | None
    size: int = 0
    rate: float = 0.0
    probe: bool = False
    bucket: int = 0  # the confidence class whose estimates priced it (see size_class)


@dataclass
class ArmState:
    """Online estimates for one arm."""

    alphas: list[float]  # on-demand arms, chains and small trees
    buckets: dict[int, list[float]] = field(default_factory=dict)  # larger offered trees
    draft_seconds: float | None = None  # measured, per token (chains) or per step (trees)
    # catch-ups measured (draft models): decayed sums of the seconds beyond one forward's fixed
    # cost and of the tokens read, so a long pass weighs its length
    catch_up_excess: float = 0.0
    catch_up_tokens: float = 0.0
    nodes: float = 0.0  # trees: moving averages of drafted nodes and depth
    depth: float = 0.0
    chosen: int = 0
    observed: int = 0
    since_chosen: int = 0
    probe_interval: int = 8

    @property
    def catch_up_seconds(self) -> float | None:
        """Measured catch-up cost per committed token read, beyond one forward (``None``:
        none measured)."""
        return self.catch_up_excess / self.catch_up_tokens if self.catch_up_tokens else None

    def alphas_for(self, bucket: int, prior: float) -> list[float]:
        if bucket == 0:
            return self.alphas
        return self.buckets.setdefault(bucket, [prior] * len(self.alphas))


@dataclass
class Controller:
    """Chooses an arm and a draft size per step; see the module doc."""

    arms: Sequence[ArmSpec]
    costs: CostModel = field(default_factory=CostModel.prior)
    config: ControllerConfig = field(default_factory=ControllerConfig)
    state: dict[str, ArmState] = field(default_factory=dict)
    # (tokens produced, ran to its limit) of recent requests, newest last
    lengths: deque[tuple[int, bool]] = field(default_factory=lambda: deque(maxlen=LENGTH_HISTORY))

    def __post_init__(self) -> None:
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ConfigError(f"arm names must be distinct, got {names}")
        for a in self.arms:
            if a.guard is not None and a.guard not in names:
                raise ConfigError(f"arm {a.name} is guarded by {a.guard!r}, which is no arm")
        self._specs = {a.name: a for a in self.arms}
        cfg = self.config
        for a in self.arms:
            self.state.setdefault(
                a.name,
                ArmState(
                    alphas=[cfg.prior_alpha] * max(cfg.max_draft, 64 if a.tree else 0),
                    nodes=float(cfg.default_tree_nodes),
                    depth=float(min(cfg.default_tree_nodes, cfg.max_draft)),
                    probe_interval=cfg.probe_every,
                ),
            )

    # -- deciding -------------------------------------------------------------------------------
    def _draft_time(self, spec: ArmSpec, k: int) -> float:
        """Drafting time of ``k`` tokens (chains) or one tree; offered drafts are already paid."""
        if not spec.on_demand:
            return 0.0
        measured = self.state[spec.name].draft_seconds
        unit = measured if measured is not None else spec.draft_cost * self.costs.cost(1)
        return unit if spec.tree else unit * k

    def _alphas(self, name: str, bucket: int) -> list[float]:
        return self.state[name].alphas_for(bucket, self.config.prior_alpha)

    def _tree_rate(
        self,
        spec: ArmSpec,
        depth: int,
        nodes: int,
        bucket: int = 0,
        alphas: list[float] | None = None,
    ) -> float:
        alphas = self._alphas(spec.name, bucket) if alphas is None else alphas
        seconds = self.costs.cost(nodes, tree=True) + self._draft_time(spec, depth)
        return expected_tokens(alphas, depth) / seconds

    def _chain_best(
        self, spec: ArmSpec, cap: int, alphas: list[float] | None = None
    ) -> tuple[int, float]:
        """The chain length in 1..cap with the best rate, and that rate (at ``alphas``, by
        default the arm's estimates)."""
        alphas = self.state[spec.name].alphas if alphas is None else alphas
        best_k, best = 0, 0.0
        for k in range(1, cap + 1):
            rate = expected_tokens(alphas, k) / (self.costs.cost(k + 1) + self._draft_time(spec, k))
            if rate > best:
                best_k, best = k, rate
        return best_k, best

    def _blocked(self, spec: ArmSpec) -> bool:
        """The guardrail: an adaptive arm whose first-position acceptance is below its static
        guard's, once both have been observed, is not chosen on its estimate."""
        if spec.guard is None:
            return False
        mine, theirs = self.state[spec.name], self.state[spec.guard]
        return mine.observed > 0 and theirs.observed > 0 and mine.alphas[0] < theirs.alphas[0]

    def _best_case_rate(self, spec: ArmSpec, cap: int) -> float:
        """The arm's rate if every token it drafted were accepted."""
        st = self.state[spec.name]
        certain = [1.0] * len(st.alphas)
        if spec.tree:
            nodes, depth = max(1, round(st.nodes)), max(1, round(st.depth))
            return self._tree_rate(spec, min(depth, nodes), nodes + 1, alphas=certain)
        return self._chain_best(spec, cap, alphas=certain)[1]

    def _pass_overhead(self, spec: ArmSpec) -> float:
        """The fixed part of a catch-up pass: one forward of the draft (its measured time per
        drafted token; 0 for tree drafters, whose time is per step, and before it is timed)."""
        st = self.state[spec.name]
        return st.draft_seconds if st.draft_seconds is not None and not spec.tree else 0.0

    def catch_up_cost(self, spec: ArmSpec, tokens: int) -> float:
        """Seconds for ``spec`` to read ``tokens`` committed tokens before it can draft: one
        forward plus the measured cost per token beyond it, or (unmeasured, or sampled
        requests' frozen costs) its per-token drafting cost times the target's per-token cost
        of a long pass, since a draft model reads a gap in one pass as the target reads a
        prompt. Why affine: the catch-ups after a few skipped steps read 2-5 tokens in a pass
        that costs about one forward, and priced per token alone they made a long prompt's
        catch-up look several times dearer than it was, so the draft stopped being tried on
        later requests (experiments/auto/)."""
        if tokens <= 0 or not spec.on_demand:
            return 0.0
        measured = self.state[spec.name].catch_up_seconds
        if measured is not None and not self.costs.frozen:
            return self._pass_overhead(spec) + measured * tokens
        st = self.state[spec.name]
        per_token = (
            st.draft_seconds
            if st.draft_seconds is not None and not spec.tree and not self.costs.frozen
            else spec.draft_cost * self.costs.cost(1)
        )
        return per_token * self.costs.prefill_ratio() * tokens

    def _worth_exploring(
        self, spec: ArmSpec, cap: int, plain: float, catch_up: float, remaining: int
    ) -> bool:
        """Whether a probe that first costs ``catch_up`` seconds is worth making: the catch-up
        is at most EXPLORE_SHARE of what the arm would save over the ``remaining`` tokens at
        full acceptance. Why not the estimates: a probe exists to correct them; why not the
        best case alone: at full acceptance a draft can look worth reading a long prompt with
        few tokens left, and at the acceptance it really gets (a RAG answer) such a probe took
        a large share of the answer's time (experiments/kquant/2026-12-05-kquant-auto.md)."""
        best = self._best_case_rate(spec, cap)
        if best <= 0.0:
            return False
        saving = remaining / plain - remaining / best
        return catch_up <= EXPLORE_SHARE * saving

    def _hopeless(self, spec: ArmSpec, cap: int, plain: float) -> bool:
        """Whether an on-demand arm would lose to plain decoding even if every token it drafted
        were accepted, at its measured drafting time and the cost model's verification.

        Why: where verification is steep (llama.cpp's kernels: two tokens cost well over one
        decode step) and a draft token is not cheap, even a fully accepted draft loses to plain
        decoding (experiments/llamacpp/2026-12-04-llamacpp-plain-gap.md); probing it anyway
        costs its catch-up (reading the whole prompt: seconds on a long one) besides the probe.
        Such an arm is probed only every HOPELESS_PROBE_FACTOR * max_probe_every steps, so a
        changed cost can still bring it back. Unmeasured arms are never hopeless: their first
        probe measures them."""
        st = self.state[spec.name]
        if not spec.on_demand or st.draft_seconds is None or cap < 1:
            return False
        return self._best_case_rate(spec, cap) <= plain

    def option(self, spec: ArmSpec, offer: object | None, cap: int) -> tuple[int, float, int]:
        """(size, rate, confidence class) of drafting with ``spec`` this step; size 0 when it
        cannot draft. ``offer``: the already proposed draft of an offered arm, else None."""
        if not spec.on_demand:
            if not isinstance(offer, DraftTree) or offer.num_drafted == 0:
                return 0, 0.0, 0
            if offer.is_chain and not spec.tree:  # a tree drafter's draft is taken whole
                return (*self._chain_best(spec, min(cap, offer.num_drafted)), 0)
            bucket = size_class(offer)
            rate = self._tree_rate(spec, max(offer.depths), len(offer), bucket)
            return offer.num_drafted, rate, bucket
        if spec.tree:
            st = self.state[spec.name]
            nodes, depth = max(1, round(st.nodes)), max(1, round(st.depth))
            return nodes, self._tree_rate(spec, min(depth, nodes), nodes + 1), 0
        return (*self._chain_best(spec, cap), 0)

    def choose(
        self,
        offers: Mapping[str, object] | None = None,
        cap: int | None = None,
        *,
        remaining: int | None = None,
        pending: Mapping[str, int] | None = None,
    ) -> Choice:
        """The best arm and size for this step (``Choice(None)``: draft nothing).

        ``offers`` maps offered arms to the draft they proposed this step; ``cap`` bounds
        chain lengths (the request's remaining tokens and context). ``pending``: committed
        tokens each on-demand arm must read before drafting (its catch-up), priced over the
        request's ``remaining`` tokens (both or neither; see the module doc)."""
        offers = offers or {}
        pending = pending or {}
        cap = self.config.max_draft if cap is None else max(0, min(cap, self.config.max_draft))
        plain = 1.0 / self.costs.cost(1)
        best = Choice(None, 0, plain)
        probe: Choice | None = None
        available: list[str] = []
        for spec in self.arms:
            size, rate, bucket = self.option(spec, offers.get(spec.name), cap)
            if size == 0 and not (spec.on_demand and cap > 0):
                continue
            left = remaining if remaining is not None and remaining > 0 else 0
            catch_up = self.catch_up_cost(spec, pending.get(spec.name, 0)) if left else 0.0
            if catch_up > 0.0 and rate > 0.0:  # paid once, over the tokens left
                rate = 1.0 / (1.0 / rate + catch_up / left)
            available.append(spec.name)
            if size > 0 and rate > best.rate and not self._blocked(spec):
                best = Choice(spec.name, size, rate, bucket=bucket)
            st = self.state[spec.name]
            due = probe is None and cap > 0 and st.since_chosen >= st.probe_interval
            if due and st.since_chosen < HOPELESS_PROBE_FACTOR * self.config.max_probe_every:
                due = not self._hopeless(spec, cap, plain)  # priced only when a probe is due
            if due and catch_up > 0.0:
                due = self._worth_exploring(spec, cap, plain, catch_up, left)
            if due:
                probe_size = size if spec.tree or size == 0 else 1
                probe = Choice(spec.name, max(1, probe_size), rate, True, bucket)
        if probe is not None:
            best = probe
        for name in available:
            st = self.state[name]
            st.since_chosen = 0 if name == best.arm else st.since_chosen + 1
        if best.arm is not None:
            self.state[best.arm].chosen += 1
        return best

    def expected_left(self, generated: int, remaining: int) -> int:
        """Tokens a request that has produced ``generated`` and may produce ``remaining`` more
        is expected to still produce, from the recent requests' lengths (see the module doc):
        ``remaining`` where none ran past ``generated`` or none is recorded.

        >>> c = Controller([ArmSpec("a")])
        >>> c.expected_left(0, 128)
        128
        >>> for produced, limited in ((20, False), (30, False), (128, True)):
        ...     c.record_length(produced, limited)
        >>> c.expected_left(0, 128), c.expected_left(25, 103), c.expected_left(40, 88)
        (60, 54, 88)
        """
        left = [
            remaining if limited else min(remaining, produced - generated)
            for produced, limited in self.lengths
            if limited or produced > generated
        ]
        if not left:
            return remaining
        return max(1, -(-sum(left) // len(left)))

    def record_length(self, produced: int, limited: bool) -> None:
        """A request ended after producing ``produced`` tokens (``limited``: it reached its
        limit, so it could have gone on)."""
        self.lengths.append((max(0, produced), limited))

    # -- learning ---------------------------------------------------------------------------------
    def observe(self, choice: Choice, depth: int, accepted: int, nodes: int | None = None) -> None:
        """Update the chosen arm's estimates from one verification: ``depth`` drafted, the
        first ``accepted`` accepted (position accepted+1, if drafted, rejected)."""
        if choice.arm is None or depth == 0:
            return
        st = self.state[choice.arm]
        st.observed += 1
        d = self.config.decay
        alphas = self._alphas(choice.arm, choice.bucket)
        for i in range(min(depth, accepted + 1, len(alphas))):
            hit = 1.0 if i < accepted else 0.0
            alphas[i] = d * alphas[i] + (1 - d) * hit
        if nodes is not None and self._specs[choice.arm].tree:
            st.nodes = d * st.nodes + (1 - d) * nodes
            st.depth = d * st.depth + (1 - d) * depth
        if choice.probe:
            failed = not self._probe_paid(choice, depth, accepted, nodes)
            st.probe_interval = (
                min(2 * st.probe_interval, self.config.max_probe_every)
                if failed
                else self.config.probe_every
            )

    def _probe_paid(self, choice: Choice, depth: int, accepted: int, nodes: int | None) -> bool:
        """Whether a probe beat plain decoding's rate on its own: its tokens (accepted + 1) per
        the time its verification and drafting took, priced by the cost model.

        Why not "anything accepted": where verification is steep (llama.cpp's kernels) a draft
        model's one-token probe is accepted most of the time and still loses, so resetting the
        interval on every acceptance kept probing it at the shortest interval
        (experiments/llamacpp/2026-12-04-llamacpp-target-28.md); now such probes back off like
        rejected ones, while a probe that pays brings its arm back as before."""
        spec = self._specs[choice.arm] if choice.arm is not None else None
        if spec is None or accepted == 0:
            return False
        if spec.tree:
            verify = self.costs.cost((nodes if nodes is not None else depth) + 1, tree=True)
        else:
            verify = self.costs.cost(depth + 1)
        seconds = verify + self._draft_time(spec, depth)
        return (accepted + 1) / seconds > 1.0 / self.costs.cost(1)

    def observe_draft_time(self, arm: str, amount: int, seconds: float) -> None:
        """Measured drafting time of ``amount`` tokens (chains) or one tree (amount 1); ignored
        when the cost model is frozen, so sampled requests never depend on timing."""
        if self.costs.frozen or amount < 1 or arm not in self.state:
            return
        spec = self._specs[arm]
        unit = seconds if spec.tree else seconds / amount
        st = self.state[arm]
        d = self.costs.decay
        st.draft_seconds = (
            unit if st.draft_seconds is None else d * st.draft_seconds + (1 - d) * unit
        )

    def observe_catch_up(self, arm: str, tokens: int, seconds: float) -> None:
        """Measured catch-up: ``seconds`` to read ``tokens`` committed tokens; ignored when
        the cost model is frozen (sampled requests never depend on timing)."""
        if self.costs.frozen or tokens < 1 or not seconds > 0 or arm not in self.state:
            return
        st = self.state[arm]
        d = self.costs.decay ** (tokens / CATCH_UP_MEMORY)  # old evidence fades per token read
        excess = max(0.0, seconds - self._pass_overhead(self._specs[arm]))
        st.catch_up_excess = d * st.catch_up_excess + excess
        st.catch_up_tokens = d * st.catch_up_tokens + tokens

    def counts(self) -> dict[str, int]:
        """How often each arm was chosen (the statistics' choice counts come per request)."""
        return {name: st.chosen for name, st in self.state.items()}
