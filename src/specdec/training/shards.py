"""Compact, committable self-distilled data: token-id shards with a checksummed manifest.

A data set of the target's answers is small enough to commit (a few MB per 10k answers) when
stored as what it is, token ids, in the narrowest integer type the vocabulary fits (uint16 for
SmolLM2's 49,152). Committed, it lets a speculator be trained on a fresh machine without hours
of regeneration, and without the prompt source installed.

Layout of a token data directory::

    manifest.json                      format, target identity, source + provenance, filter
                                       counts, generation settings, shards with sha256
    tokens-000000-000500.safetensors   tokens (uint16/uint32, flat), offsets, prompt_lens,
                                       source_index, turn

Shard ``tokens-A-B`` holds the answers for conversations ``A..B-1`` of the source's fixed order,
so a rerun with the same settings resumes at the first missing shard and a larger ``--limit``
extends the data set. Shards and the manifest are written atomically (temporary file, fsync,
rename), so the directory is consistent at any moment, even while a generation is running.

:func:`load_token_data` rebuilds the :class:`~specdec.training.data.SelfDistilledData` the
trainers read; :func:`save_token_data` converts any loaded data set (including the older
``specdec-selfdistill/1`` directories) into this format.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from specdec.errors import DataError
from specdec.target.loading import LoadedModel, identity_mismatch
from specdec.training.progress import NullBar, ProgressFactory
from specdec.training.records import (
    MANIFEST,
    DataManifest,
    Record,
    SelfDistilledData,
    chunks,
    generate_batch,
)
from specdec.training.sources import (
    NGRAM,
    SHAREGPT_FILE,
    SHAREGPT_PROVENANCE,
    ChatPrompt,
    EvalOverlap,
    file_sha256,
    select_sharegpt,
    sharegpt_file,
)

FORMAT = "specdec-tokens/1"
SHARD_KEYS = ("tokens", "offsets", "prompt_lens", "source_index", "turn")
_TMP_PREFIX = ".tmp-"


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits (vocabularies up to 65,536), else uint32: half the bytes for
    the common case, never a silently wrapped id.

    >>> token_dtype(49152).name, token_dtype(65537).name
    ('uint16', 'uint32')
    """
    if vocab_size < 1:
        raise DataError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_file(start: int, end: int) -> str:
    return f"tokens-{start:06d}-{end:06d}.safetensors"


@dataclass(frozen=True)
class ShardRecord:
    """One stored answer: chat-formatted prompt + the target's response, and where the prompt
    came from (conversation position in the source, 0-based turn)."""

    tokens: Sequence[int]
    prompt_len: int
    source_index: int
    turn: int = 0


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory, fsynced and renamed over ``path``, so
    a reader (or a ``git add``) never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; data is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def encode_shard(records: Sequence[ShardRecord], dtype: np.dtype[Any]) -> bytes:
    """The safetensors bytes of one shard. Refuses an id that does not fit ``dtype`` (numpy
    would wrap it into another token without a word)."""
    lens = [len(r.tokens) for r in records]
    flat = np.fromiter((t for r in records for t in r.tokens), dtype=np.int64, count=sum(lens))
    limit = np.iinfo(dtype).max
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) > limit):
        raise DataError(
            f"a token id ({int(flat.max())}) does not fit {dtype.name}; the vocabulary is larger "
            "than the manifest says. Regenerate the data with this target"
        )
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tensors = {
        "tokens": flat.astype(dtype),
        "offsets": offsets,
        "prompt_lens": np.array([r.prompt_len for r in records], dtype=np.uint32),
        "source_index": np.array([r.source_index for r in records], dtype=np.uint32),
        "turn": np.array([r.turn for r in records], dtype=np.uint16),
    }
    return save(tensors, metadata={"format": FORMAT})


def write_shard(path: Path, records: Sequence[ShardRecord], dtype: np.dtype[Any]) -> dict[str, Any]:
    """Write one shard atomically; its manifest entry (name, counts, sha256)."""
    data = encode_shard(records, dtype)
    _atomic_write_bytes(path, data)
    return {
        "file": path.name,
        "records": len(records),
        "tokens": sum(len(r.tokens) for r in records),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def read_shard(path: Path, sha256: str | None = None) -> list[ShardRecord]:
    """The records of one shard, checked against the manifest's sha256 and for internal
    consistency, so a corrupted or half-copied file fails here rather than as odd training."""
    regen = (
        "; regenerate it: rerun the same `specdec data generate` command with this --out "
        "(it rewrites shards that fail their check)"
    )
    if not path.is_file():
        raise DataError(f"data shard {path} is missing{regen}")
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise DataError(f"data shard {path} is corrupt (its sha256 differs from {MANIFEST}){regen}")
    try:
        t = load(data)
    except (SafetensorError, ValueError) as e:
        raise DataError(f"data shard {path} cannot be read ({e}){regen}") from e
    missing = [k for k in SHARD_KEYS if k not in t]
    n = len(t.get("prompt_lens", ()))
    offsets = t.get("offsets")
    if (
        missing
        or offsets is None
        or len(offsets) != n + 1
        or int(offsets[0]) != 0
        or int(offsets[-1]) != len(t["tokens"])
        or bool(np.any(np.diff(offsets) < 0))
        or any(len(t[k]) != n for k in ("source_index", "turn"))
    ):
        raise DataError(f"data shard {path} is inconsistent{regen}")
    tokens = t["tokens"].tolist()
    off = offsets.tolist()
    out = []
    for i, (pl, si, tu) in enumerate(
        zip(t["prompt_lens"].tolist(), t["source_index"].tolist(), t["turn"].tolist(), strict=True)
    ):
        seq = tokens[off[i] : off[i + 1]]
        if not 0 < pl <= len(seq):
            raise DataError(f"data shard {path}: record {i} has a bad prompt length{regen}")
        out.append(ShardRecord(seq, int(pl), int(si), int(tu)))
    return out


# ------------------------------------------------------------------------------------ manifest


def _read_manifest(d: Path) -> dict[str, Any] | None:
    path = d / MANIFEST
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); regenerate the data") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise DataError(f"{path}: format {got!r} is not {FORMAT!r}; use another --out")
    return m


def is_token_data(data_dir: str | os.PathLike[str]) -> bool:
    """Whether ``data_dir`` holds data in this module's format (else the older one)."""
    path = Path(data_dir) / MANIFEST
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def compat_manifest(m: dict[str, Any]) -> DataManifest:
    """The older manifest type the trainers (and checkpoint fingerprints) read, filled from a
    token manifest."""
    gen, src = m["generation"], m["source"]
    return DataManifest(
        target=m["target"],
        prompts_file=str(src.get("path") or src.get("file", "")),
        prompts_sha256=str(src.get("sha256", "")),
        num_prompts=int(src.get("prompts", 0)),
        order_seed=int(gen.get("seed", 0)),
        max_new_tokens=int(gen["max_new_tokens"]),
        max_prompt_tokens=int(gen["max_prompt_tokens"]),
        temperature=float(gen["temperature"]),
        shard_size=int(gen["shard_size"]),
        limit=int(m.get("conversations", 0)),
        shards=tuple(s["file"] for s in m["shards"]),
        records=int(m.get("records", 0)),
        skipped_long_prompts=int(m.get("skipped_long_prompts", 0)),
        answers=str(gen.get("answers", "target")),
    )


def load_token_data(
    data_dir: str | os.PathLike[str], loaded: LoadedModel | None = None
) -> SelfDistilledData:
    """Rebuild the trainers' :class:`SelfDistilledData` from shards alone (no prompt source,
    no model run); with ``loaded``, also check the data was generated by that model."""
    d = Path(data_dir)
    m = _read_manifest(d)
    if m is None:
        raise DataError(f"{d} has no {MANIFEST}; create it with `specdec data generate`")
    try:
        manifest = compat_manifest(m)
        entries = [(str(s["file"]), str(s["sha256"])) for s in m["shards"]]
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{d / MANIFEST} is not a valid token manifest ({e})") from e
    data = SelfDistilledData(manifest)
    for name, sha in entries:
        for r in read_shard(d / name, sha):
            data.records.append(Record(tuple(r.tokens), r.prompt_len, r.source_index))
    if not data.records:
        raise DataError(f"{d} holds no training sequences")
    if loaded is not None:
        data.check_target(loaded)
    return data


def save_token_data(
    data: SelfDistilledData, out_dir: str | os.PathLike[str], *, shard_size: int = 500
) -> dict[str, Any]:
    """Write a loaded data set (e.g. an older ``specdec-selfdistill/1`` directory) as compact
    token shards; returns the manifest. ``source_index`` keeps each record's prompt-file line."""
    if shard_size < 1:
        raise DataError("shard_size must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        raise DataError(f"{out} already holds a data set; use an empty --out")
    mf = data.manifest
    dtype = token_dtype(int(mf.target.get("vocab_size", 1 << 32)))
    shards = []
    for a in range(0, len(data.records), shard_size):
        chunk = data.records[a : a + shard_size]
        recs = [ShardRecord(r.tokens, r.prompt_len, r.index) for r in chunk]
        entry = write_shard(out / shard_file(a, a + len(chunk)), recs, dtype)
        shards.append({**entry, "start": a, "end": a + len(chunk), "skipped_long_prompts": 0})
    manifest = {
        "format": FORMAT,
        "target": mf.target,
        "source": {
            "kind": "prompts",
            "path": mf.prompts_file,
            "sha256": mf.prompts_sha256,
            "prompts": mf.num_prompts,
        },
        "generation": {
            "max_new_tokens": mf.max_new_tokens,
            "max_prompt_tokens": mf.max_prompt_tokens,
            "temperature": mf.temperature,
            "seed": mf.order_seed,
            "shard_size": shard_size,
            "turns": 1,
            "answers": mf.answers,
        },
        "token_dtype": dtype.name,
        "conversations": len(data.records),
        "records": len(data.records),
        "skipped_long_prompts": mf.skipped_long_prompts,
        "shards": shards,
    }
    _atomic_write_bytes(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


# ---------------------------------------------------------------------------------- generation


def generate_sharegpt_data(
    loaded: LoadedModel,
    out_dir: str | os.PathLike[str],
    *,
    eval_dir: str | os.PathLike[str],
    source_file: str | os.PathLike[str] | None = None,
    turns: int = 1,
    limit: int | None = None,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 1024,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 16,
    shard_size: int = 500,
    progress: ProgressFactory = NullBar,
    history_from: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Have the target answer ShareGPT user prompts and store the answers as token shards.

    Prompts come in file order, deduplicated, with every prompt that overlaps an eval set under
    ``eval_dir`` dropped (see :mod:`specdec.training.sources`). With ``turns`` > 1, later user
    turns are answered too, with the target's own earlier answers as history, so the data holds
    the multi-turn contexts chat benchmarks ask about. Rerunning with the same settings resumes
    (or, with a larger ``limit``, extends) the data set in ``out_dir``; returns the manifest.

    ``history_from``: a data directory of this function with fewer turns and the same source,
    target and generation settings (the committed ``data/sharegpt-smol`` holds first turns). Its
    answers are the history of the later turns instead of being generated again (3.3M tokens,
    hours on a CPU, for the first turns of ShareGPT), and ``out_dir`` gets only the later turns'
    answers, which are exactly those of a run without ``history_from``; train on both
    directories together.
    """
    for name, value in (("max_new_tokens", max_new_tokens), ("turns", turns),
                        ("batch_size", batch_size), ("shard_size", shard_size)):  # fmt: skip
        if value < 1:
            raise DataError(f"{name} must be >= 1, got {value}")
    if limit is not None and limit < 1:
        raise DataError(f"limit must be >= 1, got {limit}")
    if temperature < 0:
        raise DataError(f"temperature must be >= 0, got {temperature}")
    tok = loaded.tokenizer
    chat = bool(getattr(tok, "chat_template", None))
    if turns > 1 and not chat:
        raise DataError("--turns > 1 needs a target with a chat template (to pass the history)")
    path = Path(source_file) if source_file is not None else sharegpt_file()
    overlap = EvalOverlap.from_eval_dir(Path(eval_dir))
    sel = select_sharegpt(path, overlap, turns=turns)
    if not sel.prompts:
        raise DataError(f"{path} holds no usable prompts")
    n = len(sel.prompts) if limit is None else min(limit, len(sel.prompts))
    ident = loaded.identity()
    vocab = max(int(ident["vocab_size"]), len(tok))
    dtype = token_dtype(vocab)
    counts = sel.counts()
    base: dict[str, Any] = {
        "format": FORMAT,
        "target": ident,
        "source": {
            "kind": "sharegpt",
            "file": SHAREGPT_FILE if path.name == SHAREGPT_FILE else path.name,
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
            "provenance": SHAREGPT_PROVENANCE,
            "order": "file order; conversations opened by a user turn; deduplicated by the "
            "opening's normalized text (lowercase, whitespace collapsed)",
            "prompts": len(sel.prompts),
            "user_turns": sum(len(p.turns) for p in sel.prompts),
            "selection": counts,
        },
        "eval_filter": {
            "rule": f"dropped if its normalized text equals an eval prompt/turn or shares any "
            f"{NGRAM}-word n-gram with one (shared/data/README.md)",
            "eval_sets": overlap.sources,
            "overlap_dropped": sel.overlap_dropped,
            "overlap_dropped_later_turns": sel.overlap_dropped_later_turns,
        },
        "overlap_dropped": sel.overlap_dropped,
        "generation": {
            "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens,
            "temperature": float(temperature),
            "seed": seed,
            "turns": turns,
            "batch_size": batch_size,
            "shard_size": shard_size,
            "chat_template": chat,
            "greedy": temperature == 0,
        },
        "token_dtype": dtype.name,
    }
    out = Path(out_dir)
    history = None
    if history_from is not None:
        if Path(history_from).resolve() == out.resolve():
            raise DataError("--history-from must be another directory than --out")
        history = _History.load(Path(history_from), base, turns)
        if n > history.covered:
            raise DataError(
                f"{history.root} answers the first {history.covered} conversations only; "
                f"extend it first, or pass --limit {history.covered}"
            )
        base["generation"]["first_turn"] = history.turns
        base["history"] = {
            "from": str(history_from),
            "turns": history.turns,
            "rule": f"turns before {history.turns} are not answered again: that directory's "
            "answers (the target's own) are their history; this one holds the later turns",
        }
    first_turn = history.turns if history is not None else 0
    out.mkdir(parents=True, exist_ok=True)
    done = _resumable_shards(out, base)
    ranges = [(a, min(a + shard_size, n)) for a in range(0, n, shard_size)]
    # a shard of an earlier run with a larger --limit covers a shorter range of this one
    covered = {(s["start"], s["end"]) for s in done.values()}
    todo = [(a, b) for a, b in ranges if not any(x == a and y >= b for x, y in covered)]
    work = {a: sum(max(len(p.turns) - first_turn, 0) for p in sel.prompts[a:b]) for a, b in ranges}
    total = sum(work.values())
    bar = progress(
        total=total,
        initial=total - sum(work[a] for a, _ in todo),
        desc="answering",
        unit="answer",
    )
    compat = DataManifest(
        target=ident, prompts_file=path.name, prompts_sha256="", num_prompts=len(sel.prompts),
        order_seed=seed, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
        temperature=float(temperature), shard_size=shard_size, limit=n,
    )  # fmt: skip
    manifest = _write_manifest(out, base, done, n)
    try:
        for a, b in todo:
            earlier = history.records(a, b) if history is not None else None
            recs, skipped = _answer(
                loaded, sel.prompts[a:b], compat, batch_size, chat, bar, earlier, first_turn
            )
            entry = write_shard(out / shard_file(a, b), recs, dtype)
            done[entry["file"]] = {**entry, "start": a, "end": b, "skipped_long_prompts": skipped}
            manifest = _write_manifest(out, base, done, n)
    finally:
        bar.close()
    return manifest


def _resumable_shards(out: Path, base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The intact shards of an earlier run with the same settings (keyed by file name); refuses
    a directory with other settings, another target or another format. A listed shard that
    fails its checksum is left out, so this run rewrites it."""
    for stale in out.glob(_TMP_PREFIX + "*"):  # a killed run's half-written temporary file
        stale.unlink(missing_ok=True)
    old = _read_manifest(out)
    if old is None:
        if any(out.glob("*.safetensors")):
            raise DataError(f"{out} holds shards but no {MANIFEST}; use an empty directory")
        return {}
    problem = identity_mismatch(old.get("target", {}), base["target"])
    if problem:
        raise DataError(f"{out} holds data from another target ({problem}); use another --out")
    keys = ("generation", "token_dtype")
    diff = [k for k in keys if old.get(k) != base[k]]
    if old.get("source", {}).get("sha256") != base["source"]["sha256"]:
        diff.append("source file")
    old_sets = old.get("eval_filter", {}).get("eval_sets")
    if old_sets != base["eval_filter"]["eval_sets"]:
        diff.append("eval sets")
    if diff:
        raise DataError(
            f"{out} holds data generated with other settings ({', '.join(diff)}); use another "
            "--out, or the same settings to resume"
        )
    done = {}
    for s in old.get("shards", []):
        try:
            read_shard(out / s["file"], s["sha256"])
        except DataError:
            continue
        done[s["file"]] = s
    return done


def _write_manifest(
    out: Path, base: dict[str, Any], done: dict[str, dict[str, Any]], n: int
) -> dict[str, Any]:
    """List the finished shards (in order, a partial last shard superseded by a longer one left
    out), write the manifest atomically, then delete the superseded files it no longer lists."""
    shards: list[dict[str, Any]] = []
    for s in sorted(done.values(), key=lambda s: (s["start"], -s["end"])):
        if not shards or s["start"] >= shards[-1]["end"]:
            shards.append(s)
    manifest = {
        **base,
        "conversations": sum(s["end"] - s["start"] for s in shards),
        "planned_conversations": n,
        "records": sum(s["records"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "skipped_long_prompts": sum(s["skipped_long_prompts"] for s in shards),
        "shards": shards,
    }
    _atomic_write_bytes(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    keep = {s["file"] for s in shards}
    for name in [k for k in done if k not in keep]:
        (out / name).unlink(missing_ok=True)
        del done[name]
    return manifest


def _answer(
    loaded: LoadedModel,
    convs: Sequence[ChatPrompt],
    manifest: DataManifest,
    batch_size: int,
    chat: bool,
    bar: Any,
    earlier: dict[tuple[int, int], ShardRecord] | None = None,
    first_turn: int = 0,
) -> tuple[list[ShardRecord], int]:
    """Answer every turn of ``convs`` (turn by turn, batched across conversations), with the
    target's own answers as the history of later turns; (records in conversation/turn order,
    prompts skipped as too long). A conversation stops at its first too-long prompt.

    Turns before ``first_turn`` are not answered: their answers come from ``earlier`` (keyed by
    source index and turn; see :class:`_History`), each checked to answer the very prompt this
    run builds, and only the later turns' records are returned. The batches of those turns are
    the ones a run answering every turn would form, so their answers are the same."""
    from specdec.request import encode_prompt

    tok = loaded.tokenizer
    history: list[list[dict[str, str]]] = [[] for _ in convs]
    alive = [len(c.turns) > first_turn for c in convs]  # the others have nothing to answer
    got: dict[tuple[int, int], ShardRecord] = {}
    skipped = 0

    def heard(ci: int, turn: int, response: Sequence[int]) -> None:
        if turn + 1 < len(convs[ci].turns):
            answer = str(tok.decode(list(response), skip_special_tokens=True)).strip()
            history[ci] += [
                {"role": "user", "content": convs[ci].turns[turn]},
                {"role": "assistant", "content": answer},
            ]

    for turn in range(max(len(c.turns) for c in convs)):
        items: list[tuple[int, list[int]]] = []
        for ci, conv in enumerate(convs):
            if not alive[ci] or turn >= len(conv.turns):
                continue
            msgs = [*history[ci], {"role": "user", "content": conv.turns[turn]}]
            ids = encode_prompt(tok, msgs if chat else conv.turns[turn], chat=chat or None)
            if turn < first_turn:
                stored = (earlier or {}).get((conv.source_index, turn))
                if stored is None:  # that run stopped here (a prompt over max_prompt_tokens)
                    alive[ci] = False
                    bar.update(len(conv.turns) - first_turn)
                    continue
                if list(stored.tokens[: stored.prompt_len]) != ids:
                    raise DataError(
                        f"the stored answer to turn {turn} of conversation {conv.source_index} "
                        "answers another prompt than this run builds (another chat template or "
                        "source?); its history would not be the target's own"
                    )
                heard(ci, turn, stored.tokens[stored.prompt_len :])
                continue
            if len(ids) > manifest.max_prompt_tokens:
                skipped += 1
                alive[ci] = False
                bar.update(len(conv.turns) - turn)  # this turn and the ones it would open
                continue
            items.append((ci, ids))
        # similar lengths in a batch waste less compute on padding; storage order stays fixed
        by_len = sorted(items, key=lambda e: (len(e[1]), e[0]))
        for batch in chunks(by_len, batch_size):
            first = convs[batch[0][0]]
            gen_seed = (manifest.order_seed * 1_000_003 + first.source_index) * 31 + turn
            outs = generate_batch(loaded, [ids for _, ids in batch], manifest, gen_seed)
            for (ci, ids), resp in zip(batch, outs, strict=True):
                got[(ci, turn)] = ShardRecord(ids + resp, len(ids), convs[ci].source_index, turn)
                heard(ci, turn, resp)
            bar.update(len(batch))
    return [got[k] for k in sorted(got)], skipped


@dataclass(frozen=True)
class _History:
    """An earlier data set whose answers are the history of a run with more turns: same source,
    eval sets, target and generation settings, so its answers are the ones this run would give
    (greedy: the target's own), and answering them again would only cost time."""

    root: Path
    turns: int  # the turns per conversation it answered (the first turn this run answers)
    shards: tuple[dict[str, Any], ...]
    covered: int  # conversations 0..covered-1 of the order are answered there

    @classmethod
    def load(cls, root: Path, base: dict[str, Any], turns: int) -> _History:
        """Check ``root`` against this run's manifest ``base``; refuse what would not give the
        answers this run would."""
        m = _read_manifest(root)
        if m is None:
            raise DataError(f"--history-from {root} holds no {MANIFEST}")
        src, gen, mine = m.get("source", {}), m.get("generation", {}), base["generation"]
        problems = []
        if src.get("kind") != "sharegpt" or src.get("sha256") != base["source"]["sha256"]:
            problems.append("another source file")
        if m.get("eval_filter", {}).get("eval_sets") != base["eval_filter"]["eval_sets"]:
            problems.append("other eval sets (another selection of conversations)")
        problem = identity_mismatch(m.get("target", {}), base["target"])
        if problem:
            problems.append(f"another target ({problem})")
        keys = ("max_new_tokens", "max_prompt_tokens", "temperature", "seed", "chat_template")
        problems += [f"{k} {gen.get(k)!r} (this run: {mine[k]!r})" for k in keys
                     if gen.get(k) != mine[k]]  # fmt: skip
        if gen.get("first_turn"):
            problems.append("no first turns of its own (it was generated --history-from)")
        if problems:
            raise DataError(
                f"--history-from {root} cannot be this run's history: {'; '.join(problems)}"
            )
        prior = int(gen.get("turns", 1))
        if turns <= prior:
            raise DataError(
                f"--history-from {root} already answers {prior} turn(s) per conversation; "
                f"--turns must be larger to add later ones"
            )
        shards = tuple(sorted(m.get("shards", []), key=lambda s: (s["start"], s["end"])))
        covered = 0
        for s in shards:
            if s["start"] > covered:
                break
            covered = max(covered, int(s["end"]))
        return cls(root, prior, shards, covered)

    def records(self, start: int, end: int) -> dict[tuple[int, int], ShardRecord]:
        """Its records of conversations ``start..end-1`` (and any others in the same shards),
        keyed by (source index, turn); read one output shard at a time, so memory stays small."""
        out = {}
        for s in self.shards:
            if s["start"] < end and s["end"] > start:
                for r in read_shard(self.root / s["file"], s["sha256"]):
                    out[(r.source_index, r.turn)] = r
        return out
