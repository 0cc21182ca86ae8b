"""Self-distilled training data: the target's own answers to training prompts.

Every trained speculator (distilled draft model, Medusa, EAGLE) learns to predict what *this*
target says, so the data is the target's output, not a human reference: ``generate_data`` runs
the target with its chat template over a prompt file and stores prompt + response token ids.

Layout of a data directory::

    manifest.json                      settings, the target's identity, the list of shards
    shard-000000-000064.safetensors    tokens (flat int32), offsets, prompt_lens, index

Shards cover fixed ranges of a seeded permutation of the prompt file, so the order is
deterministic, ``--limit N`` takes a mix of every category, and an interrupted run resumes at
the first missing shard. Each shard and the manifest are written atomically.
"""

import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdec.errors import DataError
from specdec.prompts import load_prompts, load_responses, refuse_eval_set
from specdec.target.loading import LoadedModel, identity_mismatch
from specdec.training.progress import NullBar, ProgressFactory
from specdec.training.records import (
    FORMAT,
    MANIFEST,
    DataManifest,
    Record,
    SelfDistilledData,
    chunks,
    file_digest,
    generate_batch,
)
from specdec.training.shards import is_token_data, load_token_data

ANSWERS = ("target", "source")

__all__ = [
    "FORMAT",
    "MANIFEST",
    "DataManifest",
    "Record",
    "SelfDistilledData",
    "generate_batch",
    "generate_data",
    "load_data",
    "load_data_dirs",
    "load_prompts",
    "prompt_order",
    "shard_name",
    "shard_ranges",
]


def prompt_order(n: int, seed: int) -> list[int]:
    """The deterministic order in which prompts are answered (a seeded permutation).

    >>> prompt_order(5, 0)
    [2, 1, 0, 4, 3]
    """
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def shard_ranges(limit: int, shard_size: int) -> list[tuple[int, int]]:
    """Half-open ranges of the permuted order covered by each shard.

    >>> shard_ranges(10, 4)
    [(0, 4), (4, 8), (8, 10)]
    """
    return [(s, min(s + shard_size, limit)) for s in range(0, limit, shard_size)]


def shard_name(start: int, end: int) -> str:
    return f"shard-{start:06d}-{end:06d}.safetensors"


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; data is meant to be shared
    os.replace(tmp, path)


def generate_data(
    loaded: LoadedModel,
    prompts_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_new_tokens: int = 256,
    limit: int | None = None,
    batch_size: int = 16,
    shard_size: int = 32,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    temperature: float = 0.0,
    progress: ProgressFactory = NullBar,
    answers: str = "target",
) -> DataManifest:
    """Have the target answer the prompts (batched) and store prompt + response token ids.

    Greedy by default, which is what greedy verification checks drafts against; with
    ``temperature > 0`` responses are sampled (seeded). Resumes an interrupted run in the same
    ``out_dir``; refuses to mix data from other settings or another target into it.

    ``answers="source"`` stores each line's own ``response`` instead, tokenized (cut at
    ``max_new_tokens``; the EOS follows an answer that was not cut), without running the target:
    a data set in seconds instead of hours of decoding on a CPU. A feature-level drafter trained
    on it still learns this target, since the trainers label every position with the target's
    own distribution (EAGLE: its top-k log-probabilities); only the contexts are someone else's
    text, the recipe of EAGLE-1's fixed ShareGPT answers.
    """
    if max_new_tokens < 1:
        raise DataError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if limit is not None and limit < 1:
        raise DataError(f"limit must be >= 1, got {limit}")
    if batch_size < 1 or shard_size < 1:
        raise DataError("batch_size and shard_size must be >= 1")
    if temperature < 0:
        raise DataError(f"temperature must be >= 0, got {temperature}")
    if answers not in ANSWERS:
        raise DataError(f"answers must be one of {', '.join(ANSWERS)}, got {answers!r}")
    if answers == "source" and temperature > 0:
        raise DataError("--temperature samples the target's answers; --answers source runs none")
    prompts_path = Path(prompts_file)
    prompts = load_prompts(prompts_path)
    refuse_eval_set(prompts_path)
    responses = load_responses(prompts_path) if answers == "source" else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(prompts) if limit is None else min(limit, len(prompts))
    manifest = DataManifest(
        target=loaded.identity(),
        prompts_file=str(prompts_path),
        prompts_sha256=file_digest(prompts_path),
        num_prompts=len(prompts),
        order_seed=seed,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        temperature=float(temperature),
        shard_size=shard_size,
        limit=n,
        answers=answers,
    )
    _check_resumable(out, manifest)
    order = prompt_order(len(prompts), seed)
    ranges = shard_ranges(n, shard_size)
    done = {name for name in (shard_name(a, b) for a, b in ranges) if (out / name).is_file()}
    todo = [(a, b) for a, b in ranges if shard_name(a, b) not in done]
    names = [shard_name(a, b) for a, b in ranges]
    # the manifest always lists the finished shards, so an interrupted run is still usable
    # (with a smaller --limit) and resumable
    current = _finish_manifest(out, manifest, [s for s in names if s in done])
    bar = progress(
        total=n, initial=n - sum(b - a for a, b in todo), desc="generating", unit="prompt"
    )
    try:
        for a, b in todo:
            _write_shard(loaded, prompts, order, a, b, out, manifest, batch_size, bar, responses)
            done.add(shard_name(a, b))
            current = _finish_manifest(out, manifest, [s for s in names if s in done])
    finally:
        bar.close()
    return current


def _check_resumable(out: Path, manifest: DataManifest) -> None:
    path = out / MANIFEST
    if not path.is_file():
        if any(out.glob("shard-*.safetensors")):
            raise DataError(f"{out} holds shards but no {MANIFEST}; use an empty directory")
        return
    old = DataManifest.from_json(path.read_text(encoding="utf-8"), path)
    problem = identity_mismatch(old.target, manifest.target)
    if problem:
        raise DataError(f"{out} holds data from another target ({problem}); use another --out")
    if old.settings() != manifest.settings():
        diff = [k for k, v in manifest.settings().items() if old.settings()[k] != v]
        raise DataError(
            f"{out} holds data generated with other settings ({', '.join(diff)}); use another "
            "--out, or the same settings to resume"
        )


def _write_shard(
    loaded: LoadedModel,
    prompts: Sequence[str],
    order: Sequence[int],
    start: int,
    end: int,
    out: Path,
    manifest: DataManifest,
    batch_size: int,
    bar: Any,
    sources: Sequence[str] | None = None,
) -> None:
    from specdec.request import encode_prompt

    tok = loaded.tokenizer
    encoded: list[tuple[int, list[int]]] = []
    skipped = 0
    for idx in order[start:end]:
        ids = encode_prompt(tok, prompts[idx], chat=bool(getattr(tok, "chat_template", None)))
        if len(ids) > manifest.max_prompt_tokens:
            skipped += 1
            continue
        encoded.append((idx, ids))
    if skipped:
        bar.update(skipped)
    responses: dict[int, list[int]] = {}
    if sources is not None:
        for idx, _ in encoded:
            responses[idx] = _source_answer(tok, sources[idx], manifest.max_new_tokens)
        bar.update(len(encoded))
    # similar lengths in a batch waste less compute on padding; storage order stays fixed
    by_len = sorted(encoded, key=lambda e: len(e[1])) if sources is None else []
    for batch in chunks(by_len, batch_size):
        gen_seed = manifest.order_seed * 1_000_003 + batch[0][0]
        outs = generate_batch(loaded, [ids for _, ids in batch], manifest, gen_seed)
        for (idx, _), resp in zip(batch, outs, strict=True):
            responses[idx] = resp
        bar.update(len(batch))
    flat: list[int] = []
    offsets = [0]
    prompt_lens: list[int] = []
    index: list[int] = []
    for idx, ids in encoded:  # permuted order, as stored
        flat.extend(ids + responses[idx])
        offsets.append(len(flat))
        prompt_lens.append(len(ids))
        index.append(idx)
    tensors = {
        "tokens": torch.tensor(flat, dtype=torch.int32),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int64),
        "index": torch.tensor(index, dtype=torch.int64),
    }
    fd, tmp = tempfile.mkstemp(prefix=".shard.", dir=out)
    os.close(fd)
    save_file(tensors, tmp, metadata={"skipped_long_prompts": str(skipped)})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / shard_name(start, end))


def _source_answer(tokenizer: Any, text: str, max_new_tokens: int) -> list[int]:
    """A written answer as the target's response tokens: cut at ``max_new_tokens`` as a
    generation would be, else ended by the EOS the target's own answer would end with."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) >= max_new_tokens:
        return ids[:max_new_tokens]
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + ([int(eos)] if eos is not None else [])


def _finish_manifest(out: Path, manifest: DataManifest, shards: list[str]) -> DataManifest:
    records = skipped = 0
    for name in shards:
        meta, tensors = _read_shard(out / name)
        records += len(tensors["prompt_lens"])
        skipped += int(meta.get("skipped_long_prompts", 0))
    final = DataManifest(
        **{
            **asdict(manifest),
            "shards": tuple(shards),
            "records": records,
            "skipped_long_prompts": skipped,
        }  # fmt: skip
    )
    _atomic_write_text(out / MANIFEST, final.to_json())
    return final


def _read_shard(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise DataError(f"cannot read data shard {path} (truncated or corrupt?): {e}") from e
    need = {"tokens", "offsets", "prompt_lens", "index"}
    if not need <= tensors.keys():
        raise DataError(f"data shard {path} lacks {sorted(need - tensors.keys())}")
    return meta, tensors


def load_data(
    data_dir: str | os.PathLike[str], loaded: LoadedModel | None = None
) -> SelfDistilledData:
    """Read a data directory; with ``loaded``, also check it was generated by that model."""
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(
            f"data directory {str(d)!r} does not exist; create it with `specdec data generate`"
        )
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise DataError(
            f"{d} is not a specdec data directory (no {MANIFEST}); create one with "
            "`specdec data generate`"
        )
    if is_token_data(d):  # the compact uint16/uint32 token shards (e.g. ShareGPT answers)
        return load_token_data(d, loaded)
    manifest = DataManifest.from_json(mpath.read_text(encoding="utf-8"), mpath)
    data = SelfDistilledData(manifest)
    for name in manifest.shards:
        if not (d / name).is_file():
            raise DataError(f"{d} lists shard {name} but it is missing; rerun the generation")
        _, t = _read_shard(d / name)
        tokens = t["tokens"].tolist()
        offsets = t["offsets"].tolist()
        bad = len(offsets) != len(t["prompt_lens"]) + 1 or offsets[-1] != len(tokens)
        if bad:
            raise DataError(f"data shard {d / name} is inconsistent (offsets do not match)")
        for i, (pl, idx) in enumerate(
            zip(t["prompt_lens"].tolist(), t["index"].tolist(), strict=True)
        ):
            seq = tuple(tokens[offsets[i] : offsets[i + 1]])
            data.records.append(Record(seq, int(pl), int(idx)))
    if not data.records:
        raise DataError(f"{d} holds no training sequences")
    if loaded is not None:
        data.check_target(loaded)
    return data


def load_data_dirs(
    data_dirs: Sequence[str | os.PathLike[str]], loaded: LoadedModel | None = None
) -> SelfDistilledData:
    """One data set from several directories that answer one prompt source, records in the
    order given: e.g. ShareGPT's first turns (``data/sharegpt-smol``) and the later turns that
    ``specdec data generate --turns N --history-from`` wrote elsewhere, so a data set grows
    without the committed directory being rewritten.

    Records keep their prompt's position in the source as ``index`` (categories and fixed
    held-out sets look them up by it), hence one source. One directory loads exactly as
    :func:`load_data` (same manifest, so a run's data fingerprint and checkpoints stay valid)."""
    dirs = [Path(d) for d in data_dirs]
    if not dirs:
        raise DataError("no data directory given")
    seen: set[Path] = set()
    for d in dirs:
        if d.resolve() in seen:
            raise DataError(f"data directory {d} is given twice; its answers would count double")
        seen.add(d.resolve())
    parts = [load_data(d, loaded) for d in dirs]
    if len(parts) == 1:
        return parts[0]
    first = parts[0].manifest
    for d, part in zip(dirs[1:], parts[1:], strict=True):
        problem = identity_mismatch(first.target, part.manifest.target)
        if problem:
            raise DataError(f"{d} was generated by another target than {dirs[0]} ({problem})")
        if part.manifest.prompts_sha256 != first.prompts_sha256:
            raise DataError(
                f"{d} answers another prompt source than {dirs[0]}; several data directories "
                "must answer one source (records are keyed by their prompt's position in it)"
            )
    manifest = replace(
        first,
        shards=tuple(f"{i}/{name}" for i, p in enumerate(parts) for name in p.manifest.shards),
        records=sum(p.manifest.records for p in parts),
        skipped_long_prompts=sum(p.manifest.skipped_long_prompts for p in parts),
    )
    return SelfDistilledData(manifest, [r for p in parts for r in p.records])
