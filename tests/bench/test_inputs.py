"""Data set reading, category selection and method parsing: pure and fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.bench.errors import DatasetError, UnknownCategoryError, UnknownMethodError
from specdec.bench.methods import parse_methods
from specdec.bench.workloads import load_questions, select, spread, task_group
from specdec.errors import InvalidRequestError, SpecDecError

ENGINE = ["draft", "none", "prompt-lookup"]


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
    path = write(tmp_path, [q(81, "writing"), "{not json", "", json.dumps([1]),
                            json.dumps({"question_id": 5, "turns": []}), q(400, "qa")])
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
        ("mt_bench", 81), ("qa", 321), ("mt_bench", 91), ("qa", 323)
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
    specs = parse_methods("prompt-lookup,draft:layers:8,hf,hf-prompt-lookup,hf-assisted:layers:8",
                          ENGINE)
    assert [s.label for s in specs] == ["none", "prompt-lookup", "draft:layers:8", "hf",
                                        "hf-prompt-lookup", "hf-assisted:layers:8"]
    assert [(s.backend, s.name, s.draft) for s in specs[2:]] == [
        ("engine", "draft", "layers:8"), ("hf", "greedy", None), ("hf", "prompt-lookup", None),
        ("hf", "assisted", "layers:8"),
    ]
    assert parse_methods("hf,none", ENGINE)[0].label == "none"  # the reference goes first


@pytest.mark.parametrize(
    "text,match",
    [("none,medusa", "unknown method 'medusa'"), ("draft", "needs a draft"),
     ("hf-assisted", "needs a draft"), ("hf:layers:2", "takes no draft"), ("hf,hf", "twice"),
     (" , ", "empty")],
)
def test_parse_methods_errors(text, match):
    with pytest.raises(UnknownMethodError, match=match) as e:
        parse_methods(text, ENGINE)
    assert isinstance(e.value, SpecDecError)
