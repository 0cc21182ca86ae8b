"""Draft sizes for a whole batch, from the measured cost of a batched pass.

Batching and speculation spend the same thing: rows of one verification pass. A packed pass
over B sequences costs T(total nodes) (each sequence's tree, root included; see
:mod:`specdec.batch.target`), and on a CPU T grows slowly for a handful of rows and then about
linearly once the pass is bound by arithmetic. So the draft that pays for one request alone can
cost more than it brings in a full batch, which is why serving engines turn speculation off
above a batch size. Instead of a threshold, :class:`BatchBudget` prices drafts node by node from
the measured curve and each sequence's acceptance estimate, and takes the nodes that maximise
committed tokens per second: all of them for one request alone (the single-request adaptive
budget), a few of the most likely ones in a large batch, none when batching fills the pass.

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
    """T(rows) of a batched pass in seconds, learned from every timed pass.

    Per measured row count, a moving average; between measured counts, linear interpolation;
    outside them, a decayed least-squares line T = a + b x rows over all passes (the pass is
    bound by streaming the weights at few rows and by arithmetic at many, so the line's slope is
    what extra rows cost where the batch runs, added to the measured end so the curve stays
    continuous); before two distinct row counts are seen, the
    measured end scaled by the single-sequence curve ``shape``. Extrapolating with that flat
    shape alone would price the rows a draft adds at almost nothing once the pass is
    compute-bound, and the budget would keep drafting when batching has filled the pass."""

    shape: CostModel = field(default_factory=CostModel.prior)
    decay: float = 0.8
    fit_decay: float = 0.98
    seconds: dict[int, float] = field(default_factory=dict)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, x, y, xx, xy

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        old = self.seconds.get(rows)
        d = self.decay
        self.seconds[rows] = seconds if old is None else d * old + (1 - d) * seconds
        f = self.fit_decay
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            self._sums[i] = f * self._sums[i] + v

    def line(self) -> tuple[float, float] | None:
        """(a, b) of the fitted T = a + b x rows, or ``None`` before two row counts are seen.

        >>> c = BatchCosts()
        >>> for rows, s in ((16, 1.0), (32, 1.5), (64, 2.5)):
        ...     c.observe(rows, s)
        >>> [round(v, 4) for v in c.line()]
        [0.5, 0.0312]
        """
        w, x, y, xx, xy = self._sums
        if len(self.seconds) < 2 or w <= 0:
            return None
        var = xx / w - (x / w) ** 2
        if var <= 1e-9:
            return None
        b = max(0.0, (xy / w - (x / w) * (y / w)) / var)
        a = max(0.0, y / w - b * x / w)
        return a, b

    def cost(self, rows: int) -> float:
        """
        >>> c = BatchCosts(CostModel(prior_slope=0.5, frozen=True))
        >>> c.observe(4, 2.0); c.observe(8, 3.0)
        >>> c.cost(6), c.cost(8)
        (2.5, 3.0)
        >>> round(c.cost(16), 3)  # beyond: the fitted line, 1 + 0.25 x 16
        5.0
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
        fitted = self.line()
        if fitted is not None:  # the line's slope from the measured end it lies beyond
            a, b = fitted
            return max(a + b * rows, self.seconds[end] + b * (rows - end))
        return self.seconds[end] * self.shape.ratio(rows) / self.shape.ratio(end)


@dataclass
class Candidate:
    """A sequence the budget sizes: its acceptance estimate, the most it may draft, and, when
    its (cheap) speculator has drafted already, that draft's node count and depth."""

    alphas: Sequence[float]  # P(draft i+1 accepted | 1..i accepted)
    cap: int  # remaining tokens, context room and K allow at most this many drafts
    nodes: int | None = None  # drafted nodes of the draft at hand (None: not drafted yet)
    depth: int | None = None

    def takes(self, length: int) -> tuple[int, int]:
        """(nodes, depth) it brings at the batch's draft length."""
        if self.nodes is None:
            k = min(length, self.cap)
            return k, k
        k = min(length, self.nodes)
        return k, min(k, self.depth if self.depth is not None else k)


@dataclass
class BatchBudget:
    """Chooses every greedy sequence's draft length each step (see module doc).

    With packed passes (:mod:`specdec.batch.target`) a pass costs T(total nodes), so lengths are
    chosen per sequence: every draft position of every sequence is a candidate node worth its
    probability of being accepted (the chance that it and all before it are), and the budget
    takes the most valuable nodes first, as many as raise committed tokens per second. A
    confident sequence drafts while the others do not. With padded passes (an eager attention
    model), T(rows x widest) makes one length for all the better buy, so those are priced too.

    A step with drafts costs more than T(rows) of a plain step with as many rows (the packed
    attention's second call, the commit's moves, the acceptance work: a few percent in a full
    batch, where drafting's margin is no wider; docs/batching.md), so ``costs`` learns from
    plain steps only and drafted steps teach ``overhead``, the moving ratio of their measured
    time to ``costs``' price for their rows (see :meth:`observe`).

    Probes keep the estimates honest: after ``probe_every`` steps without drafts it drafts one
    token (each probe that finds drafting still priced out doubles the gap, up to 32x; a probe
    due in a pass that carries prompt tokens waits for the next pass without them); after
    ``4 x probe_every`` steps of drafting it drafts nothing once, so the cost of the plain
    batched pass stays measured."""

    num_draft_tokens: int
    costs: BatchCosts = field(default_factory=BatchCosts)
    draft_seconds_per_token: float = 0.0
    probe_every: int = 8
    packed: bool = True
    overhead: float = 1.05  # drafted step time / T(rows) of plain steps, learned
    overhead_decay: float = 0.9
    chunk_margin: float = 2.0  # a pass carrying prompt tokens prices its drafts' time this much
    _idle: int = 0
    _busy: int = 0
    _gap: int = 0  # steps between probes now: doubles while probes find drafting priced out
    _probed: bool = False

    def __post_init__(self) -> None:
        self._gap = self.probe_every

    @property
    def resting(self) -> bool:
        """The last choice was to draft nothing and no probe is due: this step drafts nothing
        and need not even ask its speculators (at a full batch, drafting only to throw the
        drafts away costs a few percent of every step). Call :meth:`rest` for such a step."""
        return 0 < self._idle < self._gap - 1

    def rest(self) -> None:
        self._idle += 1

    def observe(self, rows: int, seconds: float, drafted: bool) -> None:
        """Learn from a timed pass: T(rows) from plain ones, ``overhead`` from drafted ones."""
        if not drafted:
            self.costs.observe(rows, seconds)
            return
        price = self.costs.cost(rows)
        if rows >= 1 and price > 0 and seconds > 0:
            ratio = min(2.0, max(0.8, seconds / price))
            d = self.overhead_decay
            self.overhead = d * self.overhead + (1 - d) * ratio

    def _rate(
        self,
        seqs: Sequence[Candidate],
        lengths: Sequence[int],
        others: Sequence[int],
        prompt: int = 0,
        prompt_share: float = 0.0,
        plain: float = 0.0,
    ) -> float:
        """Committed tokens per second of one allocation. ``prompt`` tokens ride the pass;
        ``prompt_share`` is their own cost, left out of the price, and ``plain`` is T(the
        pass's rows without drafts), from which drafts' time is scaled (see :meth:`choose`)."""
        takes = [s.takes(k) for s, k in zip(seqs, lengths, strict=True)]
        rows = self._rows(takes, others)
        seconds = self.costs.cost(rows + prompt) - prompt_share
        if prompt and self.packed and any(lengths):
            seconds = plain + self.chunk_margin * (seconds - plain)
        seconds *= self.overhead if any(lengths) else 1.0
        drafting = sum(nodes for (nodes, _), s in zip(takes, seqs, strict=True) if s.nodes is None)
        seconds += self.draft_seconds_per_token * drafting
        pairs = zip(seqs, takes, strict=True)
        tokens = sum(expected_tokens(list(s.alphas), depth) for s, (_, depth) in pairs)
        return tokens / seconds if seconds > 0 else 0.0

    def _rows(self, takes: Sequence[tuple[int, int]], others: Sequence[int]) -> int:
        """The pass's rows (prompt tokens aside) when the sized sequences bring ``takes``."""
        if self.packed:
            return sum(others) + sum(1 + nodes for nodes, _ in takes)
        width = max(max(others, default=1), 1 + max(nodes for nodes, _ in takes))
        return (len(takes) + len(others)) * width

    def _allocations(self, seqs: Sequence[Candidate], tops: Sequence[int]) -> list[list[int]]:
        """The allocations worth pricing: the most valuable nodes first (each sequence's in
        order), one more node at a time; and every length for all alike."""
        nodes: list[tuple[float, int, int]] = []  # (-value, seq, length)
        for i, (s, top) in enumerate(zip(seqs, tops, strict=True)):
            value, before = 1.0, expected_tokens(list(s.alphas), 0)
            for k in range(1, top + 1):
                now = expected_tokens(list(s.alphas), s.takes(k)[1])
                value = min(value, now - before)  # never above an earlier node of its own
                before = now
                nodes.append((-value, i, k))
        nodes.sort()
        lengths = [0] * len(seqs)
        out = [list(lengths)]
        for _, i, k in nodes:
            lengths[i] = k
            out.append(list(lengths))
        for length in range(1, max(tops, default=0) + 1):
            out.append([min(length, top) for top in tops])
        return out

    def choose(
        self,
        seqs: Sequence[Candidate],
        others: Sequence[int] = (),
        prompt: int = 0,
        max_rows: int | None = None,
    ) -> list[int]:
        """Each sequence's draft length (it drafts, or keeps, ``min(length, its draft)``).
        ``others`` are the tree sizes (nodes, root included) of the pass's sequences not sized
        here: sampled or plain ones, with their own drafts. ``prompt`` is the prompt tokens
        the pass carries for prefilling rows. ``max_rows`` caps the pass's rows, prompt tokens
        included: an allocation that would exceed it is not priced (the scheduler's limit on
        a step's cost, so a draft cannot make the slowest gap between tokens).

        The prompt chunk's own share of the pass, T(plain rows + prompt) - T(plain rows), is
        left out of the price: it is paid whether or not anyone drafts. Counting it made every
        chunk-carrying step look slow per token, so a drafted node worth less than a token of a
        plain full batch still raised *that step's* rate: at 32 clients on the bundled model
        (2026-12-04) 44 of the 50 chunk-carrying steps drafted against 7 of the 95 others, and
        speculation ran at 0.94 of plain batching.

        In such a pass the drafts' own time counts ``chunk_margin`` (2) times: a draft there must
        pay twice over. That pass is the batch's slowest step, every decoding client waits for
        it, and what drafts add to it is what the worst gaps between tokens grow by. In a small
        batch good drafts still pay twice over (4 clients keep drafting); in a full one, where a
        draft's margin is thin, they do not, and the worst gaps between tokens at 16 clients
        shrank when such passes drafted nothing (``docs/results.md``, the chunk-margin run).

        >>> costs = BatchCosts(CostModel(prior_slope=0.1, frozen=True))
        >>> BatchBudget(4, costs).choose([Candidate([0.9] * 4, 4)])
        [4]
        >>> BatchBudget(4, costs).choose([Candidate([0.05] * 4, 4)] * 16)
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        >>> BatchBudget(4, costs).choose([Candidate([0.9] * 4, 4, nodes=2, depth=2)])
        [2]
        >>> BatchBudget(4, costs).choose([Candidate([0.9] * 4, 4)] + [Candidate([0.05] * 4, 4)])
        [4, 0]
        """
        if not seqs:
            return []
        tops = [min(self.num_draft_tokens, s.cap if s.nodes is None else s.nodes) for s in seqs]
        best, best_rate = [0] * len(seqs), -1.0
        share = plain = 0.0  # the chunk's own cost and T(plain rows), the same for every allocation
        if prompt:
            plain = self.costs.cost(sum(others) + len(seqs))  # prompts ride packed passes only
            share = self.costs.cost(sum(others) + len(seqs) + prompt) - plain
        for lengths in self._allocations(seqs, tops):
            if max_rows is not None and any(lengths):
                takes = [s.takes(k) for s, k in zip(seqs, lengths, strict=True)]
                if self._rows(takes, others) + prompt > max_rows:
                    continue
            rate = self._rate(seqs, lengths, others, prompt, share, plain)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = lengths, rate
        probed, self._probed = self._probed, False
        if not any(best):
            self._busy = 0
            if any(tops):
                if probed:  # the probe's pass confirmed it: probe half as often (to 32x)
                    self._gap = min(2 * self._gap, 32 * self.probe_every)
                self._idle += 1
                probe = [min(1, top) for top in tops]
                takes = [s.takes(k) for s, k in zip(seqs, probe, strict=True)]
                fits = max_rows is None or self._rows(takes, others) <= max_rows
                if self._idle >= self._gap and not prompt and fits:  # never in the slowest step
                    self._idle = 0
                    self._probed = True
                    return probe
            return best
        self._gap = self.probe_every
        self._idle = 0
        self._busy += 1
        if self._busy >= 4 * self.probe_every:
            self._busy = 0
            return [0] * len(seqs)
        return best
