"""The harness with scripted runners over a tiny real model: order, warm-up, identity fields."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from specdec.bench.harness import BenchConfig, run_benchmark, top2_margin, total_runs
from specdec.bench.methods import MethodSpec, RunOutput
from specdec.bench.workloads import Question
from specdec.errors import InvalidRequestError
from specdec.speculators.spec import parse_spec
from specdec.target import load_model


class Scripted:
    """Returns fixed tokens; logs every call so the test can see the order."""

    def __init__(self, label: str, tokens: list[int], log: list[tuple[str, int]]) -> None:
        self.spec = MethodSpec(label, parse_spec("none"))  # the label is what counts here
        self.tokens = tokens
        self.log = log
        self.prompts: list[list[int]] = []

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        self.log.append((self.spec.label, max_new_tokens))
        self.prompts.append(list(prompt_ids))
        return RunOutput(self.tokens[:max_new_tokens], 0.5, "length")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_interleaved_order_warmup_and_identity(tiny):
    log: list[tuple[str, int]] = []
    runners = [
        Scripted("none", [5, 6, 7, 8], log),
        Scripted("same", [5, 6, 7, 8], log),
        Scripted("other", [5, 6, 9, 8], log),
    ]
    questions = [Question(i, "qa", "qa", f"p{i}", i) for i in (1, 2)]
    config = BenchConfig(max_new_tokens=4, repeats=2, warmup_tokens=2)
    records = run_benchmark(tiny, runners, questions, [[10, 11], [12, 13]], config, env={})
    assert log[:3] == [("none", 2), ("same", 2), ("other", 2)]  # warm-up, short
    assert [m for m, _ in log[3:]] == ["none", "same", "other"] * 4  # A, B, C, A, B, C ...
    assert len(log) == total_runs(3, 2, config)
    assert [(r["line"], r["repeat"]) for r in records[::3]] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    same = [r for r in records if r["method"] == "same"]
    other = [r for r in records if r["method"] == "other"]
    assert all(r["identical"] and r["first_diff"] is None for r in same)
    assert all(not r["identical"] and r["first_diff"] == 2 for r in other)
    # the target's top-2 margin at the first differing position is recorded for the verdict
    margins = {1: top2_margin(tiny, [10, 11, 5, 6])[0], 2: top2_margin(tiny, [12, 13, 5, 6])[0]}
    assert all(r["diff_margin"] == pytest.approx(margins[r["line"]]) for r in other)
    assert all(r["diff_tokens"]["reference"] == 7 for r in other)
    assert all(r["tokens_per_s"] == pytest.approx(8.0) for r in records)


def test_reference_must_come_first(tiny):
    runners = [Scripted("hf", [1], []), Scripted("none", [1], [])]
    with pytest.raises(InvalidRequestError, match="reference"):
        run_benchmark(tiny, runners, [], [], BenchConfig(), env={})


def test_warmup_prompt_is_kept_apart_from_the_benchmark_prompts(tiny):
    """A speculator that learns across requests must not see a benchmark prompt before its
    first recorded run."""
    runners = [Scripted("none", [5, 6], []), Scripted("suffix", [5, 6], [])]
    questions = [Question(1, "qa", "qa", "p1", 1)]
    config = BenchConfig(max_new_tokens=2, warmup_tokens=1)
    run_benchmark(tiny, runners, questions, [[10, 11]], config, env={}, warmup_ids=[42])
    assert all(r.prompts == [[42], [10, 11]] for r in runners)
