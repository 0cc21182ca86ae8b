"""Draft budget policies: how many tokens to draft this step.

A verification pass over n tokens costs T(n) > T(1) on a CPU (about 1.3-1.5 decode steps for
n = 2..8 on the fast fp32 path), so drafting pays only when enough of the draft is accepted.
:class:`AdaptiveBudget` estimates the acceptance probability at each draft position from the
request so far and, with a :class:`CostModel` of T(n), drafts the length that maximises expected
committed tokens per second; when nothing pays it drafts nothing, so speculation never costs much
more than plain decoding. The ATLAS-style controller (:mod:`specdec.control.controller`) extends
this from "how much" to "which speculator".

Reproducibility: a sampled request's output depends on its drafts (they consume random numbers),
so for sampled requests the budget must not depend on wall-clock measurements. The engine gives
those requests :meth:`CostModel.prior` (fixed ratios) and keeps measured costs for greedy ones,
whose output never depends on the drafts.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from specdec.errors import ConfigError


@dataclass(frozen=True)
class FixedBudget:
    """Draft K tokens per step, never past the request's remaining tokens or the context."""

    num_draft_tokens: int

    def choose(self, remaining_tokens: int, context_room: int) -> int:
        """
        >>> FixedBudget(5).choose(remaining_tokens=3, context_room=100)
        2
        """
        return max(0, min(self.num_draft_tokens, remaining_tokens - 1, context_room - 1))

    def observe(self, drafted: int, accepted: int) -> None:
        pass


@dataclass(frozen=True)
class NodeBudget:
    """For tree speculators, which size their own trees: only the context caps the node count.
    Depth, not node count, decides how many tokens a tree can add, so the remaining-token cap
    of :class:`FixedBudget` would needlessly prune trees near the end of a request (tokens
    accepted past the limit are dropped by the engine anyway)."""

    def choose(self, remaining_tokens: int, context_room: int) -> int:
        """
        >>> NodeBudget().choose(remaining_tokens=2, context_room=100)
        99
        """
        return max(0, context_room - 1)

    def observe(self, drafted: int, accepted: int) -> None:
        pass


def expected_tokens(alphas: list[float], k: int) -> float:
    """Expected tokens committed by a step drafting ``k``: 1 + sum of P(first j all accepted).

    >>> expected_tokens([0.5, 0.5], 2)
    1.75
    """
    total, run = 1.0, 1.0
    for a in alphas[:k]:
        run *= a
        total += run
    return total


def monotone(ratios: dict[int, float]) -> dict[int, float]:
    """The non-decreasing fit of ``ratios`` over n (pool-adjacent-violators, equal weights).

    >>> monotone({1: 1.0, 2: 1.3, 3: 1.1, 4: 1.5})
    {1: 1.0, 2: 1.2, 3: 1.2, 4: 1.5}
    """
    blocks: list[list[float]] = []  # [mean, count] per pooled run of sizes
    for n in sorted(ratios):
        blocks.append([ratios[n], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted = [m for m, c in blocks for _ in range(int(c))]
    return {n: round(r, 6) for n, r in zip(sorted(ratios), fitted, strict=True)}


def _interpolate(fit: dict[int, float], n: int) -> float | None:
    """T(n)/T(1) between two calibrated sizes, on the straight line joining them (a sparse
    calibration, such as the one taken on first use, times a grid of sizes, not each one);
    ``None`` outside the calibrated range, where a line would be a guess.

    >>> _interpolate({1: 1.0, 4: 1.3, 8: 1.7}, 6), _interpolate({1: 1.0, 4: 1.3}, 5)
    (1.5, None)
    """
    if n in fit:
        return fit[n]
    below = [m for m in fit if m < n]
    above = [m for m in fit if m > n]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return round(fit[lo] + (fit[hi] - fit[lo]) * (n - lo) / (hi - lo), 6)


@dataclass
class CostModel:
    """Verification time T(n) of an n-node chain or tree, and drafting time per token.

    T(n) = unit x ratio(n): ``unit`` is T(1) *now*, in seconds, and ratio(n) = T(n)/T(1) is
    the shape of the cost curve. The two are learned on different time scales, because they
    drift for different reasons:

    * the unit moves with the machine's load and with the context length (every pass attends
      over the whole cache), so it is refreshed from *every* timed pass: a pass of n nodes that
      took s seconds says T(1) = s / ratio(n). Plain steps alone would leave it stale for as
      long as speculation keeps paying, and a controller comparing a stale T(1) with fresh
      T(n) misprices plain decoding;
    * a ratio is a property of the hardware, numerics and model, so it starts from the
      calibrated one (``specdec calibrate cost``) or a generic slope (T(n)/T(1) = 1 + slope
      (n - 1)) and moves slowly (``ratio_decay``) toward what is observed (it shifts a little
      with the context: over a long cache a few nodes cost slightly more of a T(1) than over
      the calibration's short prefix, while T(1) itself grows more). A ratio is
      only learned from a pass within ``ratio_window`` passes of a plain one, against that
      plain pass: with no plain step nearby, a slower pass could be a busier machine as well
      as a dearer size, and the unit takes it. A generic slope is only a guess: the first
      observation of a size replaces it.

    Before any pass is timed the unit is 1 (costs in units of T(1), what the frozen prior
    uses); the first timed pass of any size sets it. Never mixing a measured T(n) with an
    unmeasured T(1) matters: a controller that saw only drafting steps would otherwise price
    plain decoding at one second per token and draft whatever the acceptance.
    ``seconds``/``tree_seconds`` seed the model with measured times (T(1) first).
    Drafting time per token is a moving average too (zero in the frozen prior).
    """

    prior_slope: float = 0.06
    decay: float = 0.9
    frozen: bool = False
    seconds: InitVar[dict[int, float] | None] = None
    draft_seconds_per_token: float = 0.0
    chain_ratios: dict[int, float] = field(default_factory=dict)
    tree_ratios: dict[int, float] = field(default_factory=dict)
    tree_seconds: InitVar[dict[int, float] | None] = None
    ratio_decay: float = 0.95
    ratio_window: int = 2
    unit: float | None = None
    learned_chain: dict[int, float] = field(default_factory=dict)
    learned_tree: dict[int, float] = field(default_factory=dict)
    _plain: tuple[float, int] | None = field(default=None, init=False, repr=False)  # T(1), ago
    _fitted: tuple[dict[int, float], dict[int, float]] = field(
        default_factory=lambda: ({}, {}), init=False, repr=False
    )  # monotone fits of chain_ratios and tree_ratios, what prices use

    def __post_init__(
        self, seconds: dict[int, float] | None, tree_seconds: dict[int, float] | None
    ) -> None:
        if not (0.0 <= self.decay < 1.0 and 0.0 <= self.ratio_decay < 1.0):
            raise ConfigError("cost model decays must lie in [0, 1)")
        if self.ratio_window < 0:
            raise ConfigError(f"ratio_window must be >= 0, got {self.ratio_window}")
        self._fitted = (monotone(self.chain_ratios), monotone(self.tree_ratios))
        for table, tree in ((seconds or {}, False), (tree_seconds or {}, True)):
            for n in sorted(table):
                self._absorb(n, table[n], tree)

    @classmethod
    def prior(cls) -> CostModel:
        """Fixed ratios, never updated: decisions that do not depend on timing."""
        return cls(frozen=True)

    @classmethod
    def calibrated(cls, chain_ratios: dict[int, float], tree_ratios: dict[int, float]) -> CostModel:
        """Start from measured ratios T(n)/T(1) (see :mod:`specdec.control.calibration`).

        >>> CostModel.calibrated({1: 1.0, 4: 1.2}, {4: 1.5}).cost(4, tree=True)
        1.5

        Verifying more nodes never costs less, but a calibration timed on a busy machine can
        say so (one size's passes ran in a quiet moment); prices come from each table's
        isotonic fit (:func:`monotone`; the tables themselves stay as measured), so a noisy dip
        does not make the budget aim at it.

        >>> CostModel.calibrated({1: 1.0, 5: 1.5, 6: 1.3, 7: 1.7}, {}).ratio(6)
        1.4
        """
        return cls(chain_ratios=dict(chain_ratios), tree_ratios=dict(tree_ratios))

    def frozen_prior(self) -> CostModel:
        """The calibrated ratios alone, never updated: for sampled requests, whose output
        depends on the drafts and so must not depend on timing."""
        return CostModel(
            prior_slope=self.prior_slope,
            frozen=True,
            chain_ratios=dict(self.chain_ratios),
            tree_ratios=dict(self.tree_ratios),
        )

    def _prior_ratio(self, n: int, tree: bool) -> tuple[float, bool]:
        """T(n)/T(1) before anything is observed, and whether it was calibrated."""
        chain_fit, tree_fit = self._fitted
        for table in (tree_fit, chain_fit) if tree else (chain_fit,):
            # no tree calibration: a tree costs at least a chain
            inside = _interpolate(table, n)
            if inside is not None:
                return inside, True
        return 1.0 + self.prior_slope * (n - 1), False

    def ratio(self, n: int, tree: bool = False) -> float:
        """T(n)/T(1) as currently estimated (a one-node tree is the plain pass).

        >>> CostModel.calibrated({1: 1.0, 4: 1.2}, {}).ratio(4, tree=True)
        1.2
        """
        if n <= 1:
            return 1.0
        learned = self.learned_tree if tree else self.learned_chain
        return learned[n] if n in learned else self._prior_ratio(n, tree)[0]

    def cost(self, n: int, tree: bool = False) -> float:
        """
        >>> CostModel(seconds={1: 2.0}).cost(3)  # generic slope 0.06
        2.24
        """
        return (1.0 if self.unit is None else self.unit) * self.ratio(n, tree)

    def observe(self, n: int, seconds: float, tree: bool = False) -> None:
        """One timed verification pass of ``n`` nodes (ignored when frozen).

        The unit follows every pass, so a drafting-only run still prices plain decoding at
        today's T(1), not at the default of one second:

        >>> costs = CostModel.calibrated({1: 1.0, 4: 1.25}, {})
        >>> costs.observe(4, 0.25)  # no plain step yet: T(1) = 0.25 / 1.25
        >>> round(costs.cost(1), 3)
        0.2
        >>> for _ in range(30):  # the machine gets twice as slow; only 4-token chains run
        ...     costs.observe(4, 0.5)
        >>> round(costs.cost(1), 2), costs.ratio(4)  # the unit took it, not the ratio
        (0.39, 1.25)
        """
        if not self.frozen:
            self._absorb(n, seconds, tree)

    def _absorb(self, n: int, seconds: float, tree: bool) -> None:
        if n < 1 or not seconds > 0:
            return
        tree = tree and n > 1
        if n == 1:
            self._plain = (seconds, 0)
        elif self._plain is not None:
            plain, ago = self._plain
            self._plain = (plain, ago + 1)
            if ago < self.ratio_window:
                self._learn_ratio(n, seconds / plain, tree)
        ratio = self.ratio(n, tree)
        if self.unit is None:  # the first timed pass of any size sets the unit
            self.unit = seconds / ratio
        else:
            self.unit = self.decay * self.unit + (1 - self.decay) * seconds / ratio

    def _learn_ratio(self, n: int, observed: float, tree: bool) -> None:
        learned = self.learned_tree if tree else self.learned_chain
        if n in learned:
            old = learned[n]
        else:
            old, calibrated = self._prior_ratio(n, tree)
            if not calibrated:  # a generic guess: the first observation replaces it
                old = observed
        learned[n] = self.ratio_decay * old + (1 - self.ratio_decay) * observed

    def prefill_ratio(self) -> float:
        """The lowest T(n) / (n T(1)) over the chain sizes known (calibrated or learned): what
        one token of a long pass costs, in plain steps. A draft model catching up on a prompt
        reads it in one such pass, so its catch-up is priced from this (scaled by the draft's
        own cost) before it is measured. Without any known size, the generic slope's limit.

        >>> CostModel.calibrated({1: 1.0, 8: 2.0, 64: 8.0}, {}).prefill_ratio()
        0.125
        >>> CostModel().prefill_ratio()
        0.06
        """
        sizes = [n for n in set(self._fitted[0]) | set(self.learned_chain) if n >= 2]
        if not sizes:
            return self.prior_slope
        return min(self.ratio(n) / n for n in sizes)

    def draft_cost(self, k: int) -> float:
        """Seconds to draft ``k`` tokens: zero until measured (prompt lookup stays ~zero; a
        draft model or self-speculation costs a fraction of a target pass per token)."""
        return k * self.draft_seconds_per_token

    def observe_draft(self, k: int, seconds: float) -> None:
        if self.frozen or k < 1:
            return
        per_token = seconds / k
        old = self.draft_seconds_per_token
        self.draft_seconds_per_token = (
            per_token if old == 0.0 else self.decay * old + (1 - self.decay) * per_token
        )


@dataclass
class AdaptiveBudget:
    """Cost-aware draft length for one request.

    ``alphas[i]`` estimates P(draft i+1 accepted | drafts 1..i accepted), a moving average over
    this request's steps starting from ``prior_alpha``. Every ``probe_every`` steps without a
    draft, one token is drafted so that a low estimate can recover.

    A position no step has drafted yet is priced at the estimate of the deepest position that
    has been drafted (see :meth:`estimates`), and starts its own average from there. Before
    this, a position beyond the lengths drafted so far kept ``prior_alpha`` for the whole
    request, and a budget that started short never learnt that longer drafts paid: on the
    Qwen2.5-Coder 1.5B/0.5B pair it drafted 2 tokens per step for a whole answer whose first
    two positions were nearly always accepted, slower than a fixed K = 3
    (experiments/draft-model/2026-12-01-draft-trees.md).
    """

    num_draft_tokens: int
    costs: CostModel = field(default_factory=CostModel.prior)
    decay: float = 0.8
    prior_alpha: float = 0.6
    probe_every: int = 8
    alphas: list[float] = field(default_factory=list)
    _steps_since_draft: int = 0
    _tested: list[int] = field(default_factory=list)  # steps that drafted each position

    def __post_init__(self) -> None:
        if not self.alphas:
            self.alphas = [self.prior_alpha] * self.num_draft_tokens
        self._tested = [0] * len(self.alphas)

    def estimates(self) -> list[float]:
        """The acceptance estimates :meth:`choose` prices with: ``alphas``, except that a
        position never drafted in this request takes the estimate of the deepest drafted
        position before it (conditional acceptance changes slowly with depth; the prior says
        nothing about this request).

        >>> b = AdaptiveBudget(4)
        >>> for _ in range(10):
        ...     b.observe(drafted=2, accepted=2)
        >>> [round(a, 2) for a in b.estimates()]
        [0.96, 0.96, 0.96, 0.96]
        """
        out, last = list(self.alphas), None
        for i, tested in enumerate(self._tested):
            if tested:
                last = out[i]
            elif last is not None:
                out[i] = last
        return out

    def choose(self, remaining_tokens: int, context_room: int) -> int:
        """
        >>> AdaptiveBudget(4, alphas=[0.9, 0.9, 0.9, 0.9]).choose(100, 100)
        4
        >>> AdaptiveBudget(4, alphas=[0.02, 0.02, 0.02, 0.02]).choose(100, 100)
        0

        Drafting time counts too: at 0.6 acceptance a free draft pays, one that costs 0.7 of a
        target pass per token (a large self-speculation draft) does not.

        >>> free = CostModel(seconds={1: 1.0})
        >>> AdaptiveBudget(4, free, alphas=[0.6] * 4).choose(100, 100)
        4
        >>> costly = CostModel(seconds={1: 1.0}, draft_seconds_per_token=0.7)
        >>> AdaptiveBudget(4, costly, alphas=[0.6] * 4).choose(100, 100)
        0
        """
        cap = max(0, min(self.num_draft_tokens, remaining_tokens - 1, context_room - 1))
        alphas = self.estimates()
        best_k, best_rate = 0, 1.0 / self.costs.cost(1)
        for k in range(1, cap + 1):
            seconds = self.costs.cost(k + 1) + self.costs.draft_cost(k)
            rate = expected_tokens(alphas, k) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and cap > 0 and self._steps_since_draft >= self.probe_every:
            best_k = 1
        return best_k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self._steps_since_draft += 1
            return
        self._steps_since_draft = 0
        d = self.decay
        start = self.estimates()  # a position drafted for the first time starts from these
        # positions 1..accepted were accepted; position accepted+1 (if drafted) was rejected
        for i in range(min(drafted, accepted + 1, len(self.alphas))):
            if not self._tested[i]:
                self.alphas[i] = start[i]
            self._tested[i] += 1
            hit = 1.0 if i < accepted else 0.0
            self.alphas[i] = d * self.alphas[i] + (1 - d) * hit
