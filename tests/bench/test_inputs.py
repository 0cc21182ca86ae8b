"""Data set reading, category selection and method parsing: pure and fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.bench.errors import DatasetError, UnknownCategoryError, UnknownMethodError
from specdec.bench.methods import (
    HFAssistedOptions,
    HFGreedyOptions,
    HFPromptLookupOptions,
    parse_method,
    parse_methods,
)
from specdec.bench.workloads import load_questions, select, spread, task_group
from specdec.errors import ConfigError, InvalidRequestError, SpecDecError, UnknownSpeculatorError
from specdec.speculators.spec import parse_spec


def write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def q(qid: int, cat: str, text: str = "Say hello.") -> str:
    return json.dumps({"question_id": qid, "category": cat, "turns": [text, "second turn"]})


def test_task_groups_follow_spec_bench():
    assert task_group(81, "writing") == task_group(160, "humanities") == "mt_bench"
    assert task_group(161, "translation") == "translation"
    assert task_group(560, "rag") == "rag"


def test_malformed_lines_are_reported_with_line_numbers_and_the_rest_kept(tmp_path):
    path = write(
        tmp_path,
        [
            q(81, "writing"),
            "{not json",
            "",
            json.dumps([1]),
            json.dumps({"question_id": 5, "turns": []}),
            q(400, "qa"),
        ],
    )
    data = load_questions(path)
    assert [x.question_id for x in data.questions] == [81, 400]
    assert [b.line for b in data.bad_lines] == [2, 4, 5]
    assert data.questions[0].prompt == "Say hello."  # first turn only
    assert data.groups == ["mt_bench", "qa"]


def test_missing_or_empty_dataset(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_questions(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="no usable question.*line 1"):
        load_questions(write(tmp_path, ["garbage"]))


def test_select_spreads_and_interleaves_groups(tmp_path):
    lines = [q(81 + i, "writing" if i < 10 else "coding") for i in range(20)]
    lines += [q(321 + i, "qa") for i in range(4)]
    data = load_questions(write(tmp_path, lines))
    picked = select(data, None, 2)
    assert [(x.group, x.question_id) for x in picked] == [
        ("mt_bench", 81),
        ("qa", 321),
        ("mt_bench", 91),
        ("qa", 323),
    ]
    assert [x.question_id for x in select(data, ["coding"], 1)] == [91]
    assert len(select(data)) == 24
    assert spread(80, 5) == [0, 16, 32, 48, 64]


def test_select_rejects_unknown_category_and_bad_count(tmp_path):
    data = load_questions(write(tmp_path, [q(321, "qa")]))
    with pytest.raises(UnknownCategoryError, match="'poetry'.*task groups.*qa"):
        select(data, ["poetry"])
    with pytest.raises(InvalidRequestError, match="per-category must be >= 1"):
        select(data, None, 0)


def test_parse_methods():
    text = (
        "prompt-lookup,draft:layers:8,eagle:dir=d,tree=5x4x24,hf,hf-prompt-lookup:k=3,"
        "hf-assisted:layers:8"
    )
    specs = parse_methods(text)
    assert [s.label for s in specs] == [
        "none",
        "prompt-lookup",
        "draft:layers:8",
        "eagle:dir=d,tree=5x4x24",
        "hf",
        "hf-prompt-lookup:k=3",
        "hf-assisted:layers:8",
    ]  # labels: the specs as written
    assert specs[2].options == parse_spec("draft:model=layers:8")
    assert specs[3].options == parse_spec("eagle:dir=d,tree=5x4x24")
    assert [type(s.options) for s in specs[4:]] == [
        HFGreedyOptions,
        HFPromptLookupOptions,
        HFAssistedOptions,
    ]
    assert [s.baseline for s in specs] == [False] * 4 + [True] * 3
    assert specs[5].options.k == 3 and specs[6].options.draft == "layers:8"
    assert parse_methods("hf,none")[0].label == "none"  # the reference goes first
    # an explicit key is the same baseline as the primary value
    assert parse_method("hf-assisted:draft=layers:2").options == HFAssistedOptions(draft="layers:2")


@pytest.mark.parametrize(
    "text,error,match",
    [
        (
            "none,medusa2",
            UnknownSpeculatorError,
            "unknown name 'medusa2'; available: .*hf-assisted",
        ),
        ("none,medusa", ConfigError, "'medusa' needs dir="),
        ("hf-assisted", ConfigError, "needs draft="),
        ("hf-assisted:layers:x", UnknownMethodError, "expected layers:N"),
        ("hf:draft=x", ConfigError, "no option 'draft'; its options: k"),
        ("hf:k=two", ConfigError, "k must be an integer"),
        ("hf,hf", UnknownMethodError, "twice"),
        ("draft:layers:8,draft:model=layers:8", UnknownMethodError, "twice .*'draft:layers:8'"),
        ("auto:arms=[suffix", ConfigError, "unbalanced"),
        (" , ", UnknownMethodError, "empty"),
    ],
)
def test_parse_methods_errors(text, error, match):
    with pytest.raises(error, match=match) as e:
        parse_methods(text)
    assert isinstance(e.value, SpecDecError)
