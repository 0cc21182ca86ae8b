"""Draft sizes for a whole batch, from the measured cost of a batched pass.

Batching and speculation spend the same thing: rows of one verification pass. A pass over B
sequences each bringing a tree of ``w`` nodes costs T(B x w) (trees are padded to the widest),
and on a CPU T grows slowly for a handful of rows and then about linearly once the pass is
bound by arithmetic. So the draft length that pays for one request alone can cost more than it
brings in a full batch, which is why serving engines turn speculation off above a batch size.
Instead of a threshold, :class:`BatchBudget` prices every candidate draft length ``L`` for the
batch from the measured curve and each sequence's acceptance estimate, and drafts the ``L``
that maximises committed tokens per second (``L = 0``, plain batched decoding, when drafting
does not pay). With one sequence this is the single-request adaptive budget.

Only greedy sequences follow the batch's choice: a sampled sequence's output depends on its
drafts (they consume its random numbers), so it keeps its own timing-free budget and its seeded
output never depends on what it was batched with.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.control.budget import CostModel, expected_tokens


@dataclass
class BatchCosts:
    """T(rows) of a batched pass in seconds: a moving average per measured row count; between
    measured counts, linear interpolation; outside them, the measured end scaled by the shape
    of the single-sequence cost curve ``shape`` (calibrated, or its generic prior)."""

    shape: CostModel = field(default_factory=CostModel.prior)
    decay: float = 0.8
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        old = self.seconds.get(rows)
        self.seconds[rows] = (
            seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        )

    def cost(self, rows: int) -> float:
        """
        >>> c = BatchCosts(CostModel(prior_slope=0.5, frozen=True))
        >>> c.observe(4, 2.0); c.observe(8, 3.0)
        >>> c.cost(6), c.cost(8)
        (2.5, 3.0)
        >>> round(c.cost(10), 3)  # beyond: 3.0 x ratio(10) / ratio(8) = 3 x 5.5 / 4.5
        3.667
        """
        if rows in self.seconds:
            return self.seconds[rows]
        if not self.seconds:
            return self.shape.cost(rows)
        known = sorted(self.seconds)
        i = bisect.bisect_left(known, rows)
        if 0 < i < len(known):
            lo, hi = known[i - 1], known[i]
            f = (rows - lo) / (hi - lo)
            return (1 - f) * self.seconds[lo] + f * self.seconds[hi]
        end = known[0] if i == 0 else known[-1]
        return self.seconds[end] * self.shape.ratio(rows) / self.shape.ratio(end)


@dataclass
class Candidate:
    """A sequence the budget sizes: its acceptance estimate and the most it may draft."""

    alphas: Sequence[float]  # P(draft i+1 accepted | 1..i accepted)
    cap: int  # remaining tokens, context room and K allow at most this many drafts


@dataclass
class BatchBudget:
    """Chooses one draft length for the batch's greedy sequences each step (see module doc).

    ``probe_every``: after that many steps without drafts, draft one token, so estimates of
    acceptance and of the wider pass's cost can recover."""

    num_draft_tokens: int
    costs: BatchCosts = field(default_factory=BatchCosts)
    draft_seconds_per_token: float = 0.0
    probe_every: int = 8
    _idle: int = 0
    last_rate: float = 0.0

    def choose(self, seqs: Sequence[Candidate], others: int = 0, floor_width: int = 1) -> int:
        """The draft length ``L`` (each sequence drafts ``min(L, cap)``). ``others`` sequences
        of the pass are not sized here (sampled or plain ones, with their own drafts, the
        widest ``floor_width`` nodes): they add rows and set a floor on the pass's width.

        >>> costs = BatchCosts(CostModel(prior_slope=0.1, frozen=True))
        >>> BatchBudget(4, costs).choose([Candidate([0.9] * 4, 4)])
        4
        >>> BatchBudget(4, costs).choose([Candidate([0.05] * 4, 4)] * 16)
        0
        """
        if not seqs:
            return 0
        n = len(seqs) + others
        floor = max(1, floor_width)
        top = max(min(self.num_draft_tokens, s.cap) for s in seqs)
        best_l, best_rate = 0, -1.0
        for length in range(top + 1):
            takes = [min(length, s.cap) for s in seqs]
            width = max(floor, 1 + max(takes))
            seconds = self.costs.cost(n * width) + self.draft_seconds_per_token * sum(takes)
            tokens = sum(
                expected_tokens(list(s.alphas), k) for s, k in zip(seqs, takes, strict=True)
            )
            rate = tokens / seconds if seconds > 0 else 0.0
            if rate > best_rate * (1 + 1e-9):
                best_l, best_rate = length, rate
        self.last_rate = best_rate
        if best_l == 0 and top > 0:
            self._idle += 1
            if self._idle >= self.probe_every:
                self._idle = 0
                return 1
        else:
            self._idle = 0
        return best_l
