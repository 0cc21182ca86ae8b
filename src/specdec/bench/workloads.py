"""Question files (Spec-Bench / MT-bench JSONL) and their task groups.

Spec-Bench reports six task groups. Its file has no literal ``mt_bench`` category: the 80
MT-bench questions (ids 81-160) carry their MT-bench sub-categories (writing, roleplay, ...), so
the group of a question is derived from its id first and its category second. Any other JSONL
with ``question_id``/``category``/``turns`` works too; unknown categories become their own group.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.errors import DatasetError, UnknownCategoryError
from specdec.errors import InvalidRequestError

TASK_GROUPS: tuple[str, ...] = (
    "mt_bench",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
)
MT_BENCH_IDS = range(81, 161)
# Spec-Bench's 480 questions, shipped in the package (provenance and licence: data/README.md):
# the default data set of ``specdec bench``.
SPEC_BENCH_QUESTIONS = Path(__file__).resolve().parent / "data" / "spec_bench_questions.jsonl"
MT_BENCH_CATEGORIES: frozenset[str] = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


@dataclass(frozen=True)
class Question:
    """One benchmark prompt: only the first turn is used (single-turn decoding speed)."""

    question_id: int | str
    category: str  # as written in the file
    group: str  # Spec-Bench task group (see :func:`task_group`)
    prompt: str
    line: int  # 1-based line in the file, for messages


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str


@dataclass(frozen=True)
class Dataset:
    path: Path
    questions: tuple[Question, ...]
    bad_lines: tuple[BadLine, ...] = field(default_factory=tuple)

    @property
    def groups(self) -> list[str]:
        """Groups present, Spec-Bench's order first, others in order of appearance."""
        seen = list(dict.fromkeys(q.group for q in self.questions))
        return [g for g in TASK_GROUPS if g in seen] + [g for g in seen if g not in TASK_GROUPS]


def task_group(question_id: int | str, category: str) -> str:
    """Spec-Bench task group of a question.

    >>> task_group(81, "writing"), task_group(200, "translation"), task_group(7, "math")
    ('mt_bench', 'translation', 'mt_bench')
    >>> task_group(9000, "poetry")
    'poetry'
    """
    if isinstance(question_id, int) and question_id in MT_BENCH_IDS:
        return "mt_bench"
    if category in MT_BENCH_CATEGORIES:
        return "mt_bench"
    return category


def _parse_line(text: str, line: int) -> Question:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ValueError("no 'turns' list")
    first = turns[0]
    if isinstance(first, dict):  # Arena-Hard style {"content": ...}
        first = first.get("content")
    if not isinstance(first, str) or not first.strip():
        raise ValueError("the first turn is not a non-empty string")
    qid = record.get("question_id", line)
    if not isinstance(qid, (int, str)) or isinstance(qid, bool):
        raise ValueError("'question_id' is neither an integer nor a string")
    category = record.get("category", "default")
    if not isinstance(category, str) or not category:
        raise ValueError("'category' is not a non-empty string")
    return Question(qid, category, task_group(qid, category), first, line)


def load_questions(path: str | Path) -> Dataset:
    """Read a question file; malformed lines are collected (with line numbers), not fatal."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            f"dataset file {str(p)!r} does not exist; pass --dataset PATH to a Spec-Bench or "
            "MT-bench question.jsonl"
        )
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read dataset file {str(p)!r}: {e}") from None
    questions: list[Question] = []
    bad: list[BadLine] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            questions.append(_parse_line(text, number))
        except ValueError as e:
            bad.append(BadLine(number, str(e)))
    if not questions:
        raise DatasetError(
            f"dataset file {str(p)!r} holds no usable question"
            + (
                f" ({len(bad)} malformed lines, first at line {bad[0].line}: {bad[0].reason})"
                if bad
                else ""
            )
        )
    return Dataset(p, tuple(questions), tuple(bad))


def spread(n_items: int, n_wanted: int) -> list[int]:
    """Indices of ``n_wanted`` items spread evenly over ``n_items`` (all if fewer).

    Why: Spec-Bench files are sorted by sub-category, so the first five MT-bench questions are all
    "writing"; evenly spaced picks cover writing, roleplay, reasoning, math and coding.

    >>> spread(80, 5)
    [0, 16, 32, 48, 64]
    >>> spread(3, 5)
    [0, 1, 2]
    """
    if n_wanted >= n_items:
        return list(range(n_items))
    return [i * n_items // n_wanted for i in range(n_wanted)]


def select(
    dataset: Dataset, categories: Sequence[str] | None = None, per_category: int | None = None
) -> list[Question]:
    """Questions to run, task groups interleaved (see :func:`round_robin`).

    ``categories`` may name task groups (``mt_bench``, ``qa``) or raw categories (``writing``);
    ``per_category`` caps the questions per named entry, spread evenly over it.
    """
    if per_category is not None and (isinstance(per_category, bool) or per_category < 1):
        raise InvalidRequestError(
            f"--per-category must be >= 1, got {per_category}", param="per_category"
        )
    groups = dataset.groups
    raw = list(dict.fromkeys(q.category for q in dataset.questions))
    wanted = list(dict.fromkeys(categories)) if categories else groups
    unknown = [c for c in wanted if c not in groups and c not in raw]
    if unknown:
        extra = [c for c in raw if c not in groups]
        raise UnknownCategoryError(
            f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}"
            f"; task groups in {dataset.path.name}: {', '.join(groups)}"
            + (f"; raw categories: {', '.join(extra)}" if extra else "")
        )
    chosen: list[Question] = []
    seen: set[int] = set()
    for name in wanted:
        pool = [q for q in dataset.questions if q.group == name or q.category == name]
        picks = spread(len(pool), per_category) if per_category else range(len(pool))
        for i in picks:
            if pool[i].line not in seen:
                seen.add(pool[i].line)
                chosen.append(pool[i])
    return round_robin(chosen, groups)


def round_robin(questions: Sequence[Question], groups: Sequence[str]) -> list[Question]:
    """Interleave task groups (1st of each group, then 2nd of each, ...).

    Why: a run stopped early (or a slow stretch of the machine) then still covers every group
    about equally, instead of leaving the last groups empty.
    """
    queues = {g: [q for q in questions if q.group == g] for g in groups}
    out: list[Question] = []
    depth = max((len(v) for v in queues.values()), default=0)
    for i in range(depth):
        out.extend(queues[g][i] for g in groups if i < len(queues[g]))
    return out
