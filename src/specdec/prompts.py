"""Prompt files: JSONL lines with ``prompt`` (our training mixes) or ``turns`` (Spec-Bench /
MT-bench style), and the guard that keeps evaluation sets out of training.

Low in the layer order: the trainers, the draft-vocabulary builder and the benchmark all read
prompt files through it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdec.errors import DataError


def load_prompts(path: str | os.PathLike[str]) -> list[str]:
    """Prompts from a JSONL file: each line an object with ``prompt`` (our training mix) or
    ``turns`` (Spec-Bench / MT-bench style; the first turn is used)."""
    p = Path(path)
    prompts: list[str] = []
    for lineno, obj in json_lines(p):
        text = prompt_text(obj)
        if text is None:
            raise DataError(
                f"{p}:{lineno}: expected an object with a non-empty 'prompt' string or a "
                "'turns' list"
            )
        prompts.append(text)
    if not prompts:
        raise DataError(f"prompt file {p} holds no prompts")
    return prompts


def load_responses(path: str | os.PathLike[str]) -> list[str]:
    """The ``response`` string of every record of a prompt file, in :func:`load_prompts`'s
    order: answers written by someone else (a stronger model, a dataset's reference), which
    ``specdec data generate --answers source`` stores in place of the target's own."""
    p = Path(path)
    out: list[str] = []
    for lineno, obj in json_lines(p):
        text = obj.get("response") if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise DataError(
                f"{p}:{lineno}: --answers source needs a non-empty 'response' string on every "
                "line; add one, or let the target answer (--answers target)"
            )
        out.append(text)
    return out


def json_lines(p: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) of each non-blank line: the numbering records' ``index``
    counts in (blank lines skipped)."""
    if not p.is_file():
        raise DataError(f"prompt file {str(p)!r} does not exist")
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None


def prompt_text(obj: Any) -> str | None:
    """A prompt line's text: its ``prompt``, or its first turn; ``None`` when it has none."""
    if not isinstance(obj, dict):
        return None
    text = obj.get("prompt")
    if text is None and isinstance(obj.get("turns"), list) and obj["turns"]:
        text = obj["turns"][0]
        if isinstance(text, dict):
            text = text.get("content")
    return text if isinstance(text, str) and text.strip() else None


def refuse_eval_set(path: Path) -> None:
    """Refuse a file inside an evaluation set directory: training on it would make every
    benchmark figure meaningless."""
    parts = {p.lower() for p in path.resolve().parts}
    if "eval" in parts:
        raise DataError(
            f"{path} is inside an evaluation set directory; training on eval prompts would make "
            "every benchmark figure meaningless. Use the training prompts (data/train/...)"
        )
