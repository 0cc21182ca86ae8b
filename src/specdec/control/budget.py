"""Draft budget policies: how many tokens to draft this step.

A verification pass over n tokens costs T(n) > T(1) on a CPU (about 1.3-1.5 decode steps for
n = 2..8 on the fast fp32 path), so drafting pays only when enough of the draft is accepted.
:class:`AdaptiveBudget` estimates the acceptance probability at each draft position from the
request so far and, with a :class:`CostModel` of T(n), drafts the length that maximises expected
committed tokens per second; when nothing pays it drafts nothing, so speculation never costs much
more than plain decoding. The ATLAS-style controller (issue: adaptive speculation) extends this
from "how much" to "which speculator".

Reproducibility: a sampled request's output depends on its drafts (they consume random numbers),
so for sampled requests the budget must not depend on wall-clock measurements. The engine gives
those requests :meth:`CostModel.prior` (fixed ratios) and keeps measured costs for greedy ones,
whose output never depends on the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class CostModel:
    """Verification time T(n) of an n-node chain or tree, and drafting time per token.

    Sizes measured on this run are moving averages of the observed passes; sizes not yet seen
    are T(1) times a ratio T(n)/T(1): the calibrated one (``specdec calibrate cost``, the
    prior) when present, else a generic slope (T(n)/T(1) = 1 + slope (n - 1)). Ratios carry
    over from the calibration run even when the machine's load changes absolute times.
    Drafting time per token is a moving average too (zero in the frozen prior).
    """

    prior_slope: float = 0.06
    decay: float = 0.9
    frozen: bool = False
    seconds: dict[int, float] = field(default_factory=dict)
    draft_seconds_per_token: float = 0.0
    chain_ratios: dict[int, float] = field(default_factory=dict)
    tree_ratios: dict[int, float] = field(default_factory=dict)
    tree_seconds: dict[int, float] = field(default_factory=dict)

    @classmethod
    def prior(cls) -> CostModel:
        """Fixed ratios, never updated: decisions that do not depend on timing."""
        return cls(frozen=True)

    @classmethod
    def calibrated(cls, chain_ratios: dict[int, float], tree_ratios: dict[int, float]) -> CostModel:
        """Start from measured ratios T(n)/T(1) (see :mod:`specdec.control.calibration`).

        >>> CostModel.calibrated({1: 1.0, 4: 1.2}, {4: 1.5}).cost(4, tree=True)
        1.5
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

    def cost(self, n: int, tree: bool = False) -> float:
        """
        >>> CostModel(seconds={1: 2.0}).cost(3)  # generic slope 0.06
        2.24
        """
        measured = self.tree_seconds if tree and n > 1 else self.seconds
        if n in measured:
            return measured[n]
        base = self.seconds.get(1, 1.0)
        ratios = self.tree_ratios if tree else self.chain_ratios
        if n in ratios:
            return base * ratios[n]
        if tree and n in self.chain_ratios:  # no tree calibration: a tree costs at least a chain
            return base * self.chain_ratios[n]
        return base * (1.0 + self.prior_slope * (n - 1))

    def observe(self, n: int, seconds: float, tree: bool = False) -> None:
        if self.frozen:
            return
        table = self.tree_seconds if tree and n > 1 else self.seconds
        old = table.get(n)
        table[n] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

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
    """

    num_draft_tokens: int
    costs: CostModel = field(default_factory=CostModel.prior)
    decay: float = 0.8
    prior_alpha: float = 0.6
    probe_every: int = 8
    alphas: list[float] = field(default_factory=list)
    _steps_since_draft: int = 0

    def __post_init__(self) -> None:
        if not self.alphas:
            self.alphas = [self.prior_alpha] * self.num_draft_tokens

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
        best_k, best_rate = 0, 1.0 / self.costs.cost(1)
        for k in range(1, cap + 1):
            seconds = self.costs.cost(k + 1) + self.costs.draft_cost(k)
            rate = expected_tokens(self.alphas, k) / seconds
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
        # positions 1..accepted were accepted; position accepted+1 (if drafted) was rejected
        for i in range(min(drafted, accepted + 1)):
            hit = 1.0 if i < accepted else 0.0
            self.alphas[i] = d * self.alphas[i] + (1 - d) * hit
