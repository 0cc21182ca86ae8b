"""Benchmark statistics as pure functions over records (dicts as written to results.jsonl).

Conventions (the same as Spec-Bench's, written once here):

- **speedup** of method M over baseline B: per prompt the ratio of tokens/s, M / B, then the
  geometric mean over prompts. Ratios are paired (same prompt, same repeat), so a prompt that
  is slow for every method does not weigh more than a fast one, and the geometric mean makes
  ``speedup(A, B) == 1 / speedup(B, A)``.
- **tokens/s** of a method over a set of prompts: total new tokens / total seconds.
- **τ (mean accepted length)**: tokens committed per target forward pass, pooled over runs:
  (accepted drafts + forwards) / forwards. Plain decoding has τ = 1.
- **acceptance by position i**: pooled over runs, accepted_at[i] / drafted_at[i], i.e. among
  steps that drafted at least i+1 tokens, the fraction in which the (i+1)-th was accepted.
- Over repeats: each statistic is computed per repeat, then reported as median [min, max].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

Record = Mapping[str, Any]
NEAR_TIE_MARGIN = 1e-2  # logits; a top-2 gap this small can flip under fp reassociation


@dataclass(frozen=True)
class Spread:
    """Median with min and max over repeats."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        """
        >>> Spread.of([3.0, 1.0, 2.0])
        Spread(median=2.0, lo=1.0, hi=3.0)
        >>> Spread.of([]) is None
        True
        """
        vals = [v for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return None
        return cls(float(median(vals)), float(min(vals)), float(max(vals)))


def geometric_mean(values: Iterable[float]) -> float:
    """
    >>> geometric_mean([2.0, 0.5])
    1.0
    >>> round(geometric_mean([1.0, 4.0]), 6)
    2.0
    """
    vals = list(values)
    if not vals:
        raise ValueError("geometric mean of no values")
    if any(v <= 0 or not math.isfinite(v) for v in vals):
        raise ValueError(f"geometric mean needs finite positive values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def prompt_key(r: Record) -> tuple[Any, ...]:
    """Identifies a prompt run across methods: (question line, repeat)."""
    return (r["line"], r["repeat"])


def paired_ratios(
    records: Iterable[Record], method: str, baseline: str, key: str = "tokens_per_s"
) -> dict[tuple[Any, ...], float]:
    """Per (prompt, repeat): ``method``'s ``key`` / ``baseline``'s, where both are positive.

    >>> recs = [dict(line=1, repeat=0, method="a", tokens_per_s=20.0),
    ...         dict(line=1, repeat=0, method="b", tokens_per_s=10.0),
    ...         dict(line=2, repeat=0, method="a", tokens_per_s=5.0),
    ...         dict(line=2, repeat=0, method="b", tokens_per_s=10.0)]
    >>> paired_ratios(recs, "a", "b")
    {(1, 0): 2.0, (2, 0): 0.5}
    """
    recs = list(records)
    base = {prompt_key(r): r[key] for r in recs if r["method"] == baseline}
    out: dict[tuple[Any, ...], float] = {}
    for r in recs:
        if r["method"] != method:
            continue
        b = base.get(prompt_key(r))
        if b and b > 0 and r[key] and r[key] > 0:
            out[prompt_key(r)] = r[key] / b
    return out


def _by_repeat(records: Iterable[Record]) -> dict[int, list[Record]]:
    groups: dict[int, list[Record]] = {}
    for r in records:
        groups.setdefault(int(r["repeat"]), []).append(r)
    return dict(sorted(groups.items()))


def speedup(records: Iterable[Record], method: str, baseline: str) -> Spread | None:
    """Geometric mean of paired per-prompt ratios, per repeat; median [min, max] over repeats.

    >>> recs = [dict(line=1, repeat=0, method="a", tokens_per_s=20.0),
    ...         dict(line=1, repeat=0, method="b", tokens_per_s=10.0),
    ...         dict(line=2, repeat=0, method="a", tokens_per_s=5.0),
    ...         dict(line=2, repeat=0, method="b", tokens_per_s=10.0)]
    >>> speedup(recs, "a", "b")
    Spread(median=1.0, lo=1.0, hi=1.0)
    """
    per_repeat = []
    for recs in _by_repeat(records).values():
        ratios = paired_ratios(recs, method, baseline)
        if ratios:
            per_repeat.append(geometric_mean(ratios.values()))
    return Spread.of(per_repeat)


# two-sided 97.5% quantiles of Student's t by degrees of freedom (larger df: the next listed)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000,
         120: 1.980}  # fmt: skip


def _t975(df: int) -> float:
    return next((v for k, v in _T975.items() if df <= k), 1.960)


@dataclass(frozen=True)
class RatioInterval:
    """Geometric mean of paired per-prompt ratios with a 95% confidence interval.

    Why paired and per prompt: speed varies far more between prompts (answer length, how much
    can be copied) than between methods on one prompt, and timing noise on a shared CPU is
    per run; the spread of one prompt's ratio across prompts measures both, so an interval
    that contains 1.0 means "not distinguishable from equal with this many prompts"."""

    ratio: float
    lo: float
    hi: float
    n: int

    @property
    def verdict(self) -> str:
        if self.n < 2:
            return "one prompt: no interval"
        if self.hi < 1.0:
            return "slower"
        return "faster" if self.lo > 1.0 else "within noise"


def ratio_interval(records: Iterable[Record], method: str, baseline: str) -> RatioInterval | None:
    """``method`` ÷ ``baseline`` tokens/s over every (prompt, repeat) both ran: geometric mean
    and a t-interval on the log ratios.

    >>> pairs = [(10, 10), (11, 10), (9, 10), (10.5, 10)]
    >>> recs = [dict(line=i, repeat=0, method=m, tokens_per_s=v) for i, (a, b) in
    ...         enumerate(pairs) for m, v in (("a", a), ("b", b))]
    >>> iv = ratio_interval(recs, "a", "b"); (round(iv.ratio, 3), iv.n, iv.verdict)
    (1.01, 4, 'within noise')
    """
    logs = [math.log(x) for x in paired_ratios(records, method, baseline).values()]
    if not logs:
        return None
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return RatioInterval(math.exp(mean), math.exp(mean), math.exp(mean), 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = _t975(len(logs) - 1) * sd / math.sqrt(len(logs))
    return RatioInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))


def throughput(records: Iterable[Record], method: str) -> Spread | None:
    """Total new tokens / total seconds of ``method``, per repeat.

    >>> recs = [dict(repeat=0, method="a", new_tokens=10, seconds=1.0),
    ...         dict(repeat=0, method="a", new_tokens=30, seconds=3.0),
    ...         dict(repeat=1, method="a", new_tokens=40, seconds=2.0)]
    >>> throughput(recs, "a")
    Spread(median=15.0, lo=10.0, hi=20.0)
    """
    per_repeat = []
    for recs in _by_repeat(records).values():
        mine = [r for r in recs if r["method"] == method]
        secs = sum(r["seconds"] for r in mine)
        if mine and secs > 0:
            per_repeat.append(sum(r["new_tokens"] for r in mine) / secs)
    return Spread.of(per_repeat)


def _engine_records(records: Iterable[Record], method: str) -> list[Record]:
    return [r for r in records if r["method"] == method and r.get("target_forwards")]


def mean_accepted(records: Iterable[Record], method: str) -> float | None:
    """Pooled τ: (accepted drafts + forwards) / forwards; None for methods without engine stats.

    >>> recs = [dict(method="a", target_forwards=2, accepted_at=[2, 1]),
    ...         dict(method="a", target_forwards=2, accepted_at=[1])]
    >>> mean_accepted(recs, "a")  # (4 accepted + 4 forwards) / 4 forwards
    2.0
    """
    recs = _engine_records(records, method)
    forwards = sum(r["target_forwards"] for r in recs)
    if not forwards:
        return None
    accepted = sum(sum(r["accepted_at"]) for r in recs)
    return (accepted + forwards) / forwards


def acceptance_by_position(records: Iterable[Record], method: str) -> list[float]:
    """Pooled acceptance rate at each draft position.

    >>> recs = [dict(method="a", target_forwards=3, drafted_at=[3, 3], accepted_at=[2, 1]),
    ...         dict(method="a", target_forwards=1, drafted_at=[1], accepted_at=[1])]
    >>> acceptance_by_position(recs, "a")
    [0.75, 0.3333333333333333]
    """
    drafted: list[int] = []
    accepted: list[int] = []
    for r in _engine_records(records, method):
        for i, d in enumerate(r["drafted_at"]):
            if i >= len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += r["accepted_at"][i] if i < len(r["accepted_at"]) else 0
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=False)]


def draft_fraction(records: Iterable[Record], method: str) -> float | None:
    """Share of wall time spent drafting, pooled: sum draft_seconds / sum seconds.

    >>> draft_fraction([dict(method="a", target_forwards=1, draft_seconds=1.0, seconds=4.0)], "a")
    0.25
    """
    recs = _engine_records(records, method)
    secs = sum(r["seconds"] for r in recs)
    return sum(r["draft_seconds"] for r in recs) / secs if secs > 0 else None


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """First position where two outputs differ (a length difference counts), or None.

    >>> first_difference([1, 2, 3], [1, 2, 3]) is None
    True
    >>> first_difference([1, 2, 3], [1, 5, 3]), first_difference([1, 2, 3], [1, 2])
    (1, 2)
    """
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@dataclass(frozen=True)
class Identity:
    """Greedy outputs compared with plain decoding's on the same prompt and repeat."""

    compared: int
    differing: int
    first_diffs: tuple[int, ...] = ()
    margins: tuple[float | None, ...] = ()  # target's top-2 logit margin at each first difference

    @property
    def near_ties(self) -> int:
        """Differences at a position where the target's top-2 margin is a near-tie."""
        return sum(1 for m in self.margins if m is not None and m < NEAR_TIE_MARGIN)

    @property
    def unexplained(self) -> int:
        """Differences not explained by an fp near-tie: a real losslessness bug."""
        return self.differing - self.near_ties


def identity(records: Iterable[Record], method: str) -> Identity:
    """
    >>> recs = [dict(method="a", identical=True), dict(method="a", identical=False,
    ...          first_diff=7, diff_margin=1e-4)]
    >>> i = identity(recs, "a"); (i.compared, i.differing, i.first_diffs, i.near_ties)
    (2, 1, (7,), 1)
    """
    mine = [r for r in records if r["method"] == method and r.get("identical") is not None]
    diff = [r for r in mine if not r["identical"]]
    return Identity(
        len(mine),
        len(diff),
        tuple(int(r["first_diff"]) for r in diff),
        tuple(r.get("diff_margin") for r in diff),
    )


@dataclass(frozen=True)
class MethodSummary:
    """One row of a report table."""

    method: str
    runs: int
    tokens_per_s: Spread | None
    speedup_vs_none: Spread | None
    speedup_vs_hf: Spread | None
    mean_accepted: float | None
    speedup_vs_llamacpp: Spread | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_fraction: float | None = None
    identity: Identity = field(default_factory=lambda: Identity(0, 0))


def methods_in(records: Iterable[Record]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in records))


def complete_prompts(records: Sequence[Record]) -> list[Record]:
    """Records of the (prompt, repeat) pairs that every method ran.

    Why: a run stopped part-way through a prompt would otherwise give the methods that ran on it
    one more prompt in their tokens/s than the others.

    >>> recs = [dict(line=1, repeat=0, method="a"), dict(line=1, repeat=0, method="b"),
    ...         dict(line=2, repeat=0, method="a")]
    >>> [r["line"] for r in complete_prompts(recs)]
    [1, 1]
    """
    names = set(methods_in(records))
    seen: dict[tuple[Any, ...], set[str]] = {}
    for r in records:
        seen.setdefault(prompt_key(r), set()).add(r["method"])
    return [r for r in records if seen[prompt_key(r)] == names]


def summarize(
    records: Iterable[Record],
    *,
    reference: str = "none",
    hf_baseline: str = "hf",
    llamacpp_baseline: str = "llamacpp",
    where: Callable[[Record], bool] | None = None,
) -> list[MethodSummary]:
    """One :class:`MethodSummary` per method, over the records ``where`` keeps."""
    recs = [r for r in records if where is None or where(r)]
    names = methods_in(recs)
    out = []
    for m in names:
        out.append(
            MethodSummary(
                method=m,
                runs=sum(1 for r in recs if r["method"] == m),
                tokens_per_s=throughput(recs, m),
                speedup_vs_none=speedup(recs, m, reference) if reference in names else None,
                speedup_vs_hf=speedup(recs, m, hf_baseline) if hf_baseline in names else None,
                speedup_vs_llamacpp=(
                    speedup(recs, m, llamacpp_baseline) if llamacpp_baseline in names else None
                ),
                mean_accepted=mean_accepted(recs, m),
                acceptance_by_position=acceptance_by_position(recs, m),
                draft_fraction=draft_fraction(recs, m),
                identity=identity(recs, m),
            )
        )
    return out


def per_prompt_tau(records: Iterable[Record], method: str) -> list[float]:
    """τ of each engine run, for the τ distribution plot."""
    return [r["mean_accepted"] for r in _engine_records(records, method)]
