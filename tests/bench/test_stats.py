"""Statistics on hand-made records: every number here can be checked by hand."""

from __future__ import annotations

import doctest
import math

import pytest

from specdec.bench import methods, stats, workloads
from specdec.bench.stats import Spread


def rec(line: int, method: str, tps: float, repeat: int = 0, **extra):
    base = dict(
        line=line,
        repeat=repeat,
        method=method,
        tokens_per_s=tps,
        group="qa",
        new_tokens=int(tps * 2),
        seconds=2.0,
    )
    base.update(extra)
    return base


@pytest.mark.parametrize("module", [stats, workloads, methods])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


def test_geometric_mean_of_reciprocal_ratios_is_one():
    assert stats.geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    assert stats.geometric_mean([1.0, 2.0, 4.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        stats.geometric_mean([])
    with pytest.raises(ValueError):
        stats.geometric_mean([1.0, 0.0])


def test_speedup_is_geomean_of_per_prompt_ratios_not_ratio_of_means():
    # prompt 1: A is 4x faster; prompt 2: A is 4x slower -> geometric mean 1.0,
    # while the ratio of mean tokens/s would be (40 + 2.5) / (10 + 10) = 2.125.
    recs = [rec(1, "a", 40.0), rec(1, "b", 10.0), rec(2, "a", 2.5), rec(2, "b", 10.0)]
    assert stats.speedup(recs, "a", "b").median == pytest.approx(1.0)
    assert stats.speedup(recs, "b", "a").median == pytest.approx(1.0)
    recs2 = [rec(1, "a", 20.0), rec(1, "b", 10.0), rec(2, "a", 80.0), rec(2, "b", 10.0)]
    assert stats.speedup(recs2, "a", "b").median == pytest.approx(4.0)  # sqrt(2 * 8)


def test_speedup_pairs_by_prompt_and_repeat_and_spreads_over_repeats():
    recs = [
        rec(1, "a", 20.0, 0),
        rec(1, "b", 10.0, 0),  # repeat 0: 2x
        rec(1, "a", 30.0, 1),
        rec(1, "b", 10.0, 1),  # repeat 1: 3x
        rec(1, "a", 10.0, 2),
        rec(1, "b", 10.0, 2),  # repeat 2: 1x
        rec(2, "a", 99.0, 0),  # no baseline for this prompt: ignored
    ]
    s = stats.speedup(recs, "a", "b")
    assert (s.median, s.lo, s.hi) == pytest.approx((2.0, 1.0, 3.0))
    assert stats.speedup(recs, "a", "missing") is None


def test_throughput_pools_tokens_over_seconds():
    recs = [
        dict(repeat=0, method="a", new_tokens=10, seconds=1.0),
        dict(repeat=0, method="a", new_tokens=90, seconds=9.0),
        dict(repeat=0, method="b", new_tokens=1, seconds=1.0),
    ]
    assert stats.throughput(recs, "a") == Spread(10.0, 10.0, 10.0)


def test_tau_and_acceptance_by_position_pool_over_runs():
    # run 1: 4 steps, drafted 3 deep each time; accepted 3, 1, 0, 2 -> at = [3, 2, 1]
    # run 2: 2 steps, drafted 1 deep; accepted 1, 0 -> at = [1]
    recs = [
        dict(
            method="s",
            target_forwards=4,
            drafted_at=[4, 4, 4],
            accepted_at=[3, 2, 1],
            draft_seconds=1.0,
            seconds=5.0,
        ),
        dict(
            method="s",
            target_forwards=2,
            drafted_at=[2],
            accepted_at=[1],
            draft_seconds=0.0,
            seconds=5.0,
        ),
        dict(method="hf", target_forwards=None, drafted_at=None, accepted_at=None),
    ]
    # (6 + 1 accepted + 4 + 2 forwards) / 6 forwards
    assert stats.mean_accepted(recs, "s") == pytest.approx(13 / 6)
    assert stats.acceptance_by_position(recs, "s") == pytest.approx([4 / 6, 2 / 4, 1 / 4])
    assert stats.draft_fraction(recs, "s") == pytest.approx(0.1)
    assert stats.mean_accepted(recs, "hf") is None
    assert stats.acceptance_by_position(recs, "hf") == []
    # plain decoding: no drafts, tau = 1
    plain = [dict(method="none", target_forwards=5, drafted_at=[], accepted_at=[])]
    assert stats.mean_accepted(plain, "none") == 1.0


def test_identity_counts_and_near_ties():
    recs = [
        dict(method="a", identical=True),
        dict(method="a", identical=False, first_diff=3, diff_margin=2e-5),
        dict(method="a", identical=False, first_diff=9, diff_margin=4.0),
    ]
    ident = stats.identity(recs, "a")
    assert (ident.compared, ident.differing, ident.first_diffs) == (3, 2, (3, 9))
    assert ident.near_ties == 1 and ident.unexplained == 1


def test_first_difference():
    assert stats.first_difference([1, 2], [1, 2]) is None
    assert stats.first_difference([1, 2], [3, 2]) == 0
    assert stats.first_difference([1, 2, 3], [1, 2]) == 2
    assert stats.first_difference([], [7]) == 0


def test_summarize_rows_are_finite():
    recs = [
        rec(
            1,
            "none",
            10.0,
            target_forwards=20,
            drafted_at=[],
            accepted_at=[],
            draft_seconds=0.0,
            identical=True,
        ),
        rec(1, "hf", 12.0, identical=True),
        rec(
            1,
            "pl",
            20.0,
            target_forwards=10,
            drafted_at=[10],
            accepted_at=[10],
            draft_seconds=0.1,
            identical=True,
        ),
    ]
    by = {m.method: m for m in stats.summarize(recs)}
    assert by["pl"].speedup_vs_none.median == pytest.approx(2.0)
    assert by["pl"].speedup_vs_hf.median == pytest.approx(20 / 12)
    assert by["pl"].mean_accepted == 2.0
    assert by["hf"].mean_accepted is None
    assert all(math.isfinite(m.tokens_per_s.median) for m in by.values())


def test_pass_table_shows_each_repeat_separately():
    from specdec.bench.report import pass_table

    recs = []
    for rep in (0, 1):
        for line in (1, 2):
            recs.append(
                rec(
                    line,
                    "none",
                    10.0,
                    rep,
                    target_forwards=20,
                    accepted_at=[],
                    drafted_at=[],
                    draft_seconds=0.0,
                )
            )
            # the learning method doubles its accepted drafts on the second pass
            recs.append(
                rec(
                    line,
                    "suffix",
                    10.0 + 10 * rep,
                    rep,
                    target_forwards=10,
                    accepted_at=[5 + 5 * rep],
                    drafted_at=[10],
                    draft_seconds=0.0,
                )
            )
    lines = pass_table(recs)
    row = next(x for x in lines if x.startswith("| `suffix`"))
    assert "1.50 / 1.00×" in row and "2.00 / 2.00×" in row
    # and per task group for each pass: speedup / τ
    second = lines[lines.index("### Pass 2: speedup vs `none` / τ by task group") :]
    grid_row = next(x for x in second if x.startswith("| `suffix`"))
    assert grid_row.count("2.00× / 2.00") == 2  # the qa group and overall
    assert pass_table([r for r in recs if r["repeat"] == 0]) == []
