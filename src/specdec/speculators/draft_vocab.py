"""A draft model that scores only the most frequent tokens of its vocabulary.

A draft's LM head reads ``vocab x hidden`` weights per drafted token: for Qwen2.5-Coder-0.5B
(151,936 tokens, hidden 896) that is 136 M of its 494 M weights, 28% of what a drafted token
reads, for tokens that are mostly never drafted. ``draft:...,vocab=N`` keeps the head's rows of
the N most frequent tokens (plus the special ones) and gives every other token the logit
``-inf``: the draft then never proposes them (q = 0 there), which cannot change the output, since
the target verifies every drafted token and the sampling rule's residual ``max(p - q, 0)`` covers
whatever q leaves out. A token outside the set that the target would have chosen is simply not
drafted (that position is rejected), so N trades the head's cost against acceptance; EAGLE-3's
reduced draft vocabulary (32 k of Llama 3's 128 k) makes the same trade.

Which tokens are frequent is a property of the tokenizer and of what it is used for: a *ranking*
(token ids, most frequent first) counted over a corpus of answers. One is shipped for the
Qwen2.5 tokenizer (counted over ShareGPT's assistant answers, as ``specdec calibrate vocab
--sharegpt`` counts); ``specdec calibrate vocab`` counts one for any other tokenizer over files
a user gives, into the cache. Rankings are keyed by a digest of the tokenizer's vocabulary, so
a ranking never applies to another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import ConfigError

SHIPPED = Path(__file__).resolve().parent / "vocab"  # rankings shipped with the package
RANKING_TOKENS = 65_536  # ids stored per ranking (the largest useful draft vocabulary)


def tokenizer_digest(tokenizer: object) -> str:
    """A digest of the tokenizer's vocabulary (token string -> id): what a ranking is for."""
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    body = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    from specdec.target import files

    return files.cache_root() / "vocab"


def ranking_paths(tokenizer: object) -> list[Path]:
    """Where a ranking for ``tokenizer`` is looked for: the user's cache first (a ranking they
    counted over their own traffic wins), then the package's shipped ones."""
    name = f"{tokenizer_digest(tokenizer)}.u32"
    return [_cache_dir() / name, SHIPPED / name]


def count_tokens(tokenizer: object, texts: Iterable[str], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in ``texts`` (``[vocab_size]`` int64)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        if ids:
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[
                :vocab_size
            ]
    return counts


def texts_from_files(paths: Iterable[Path]) -> Iterator[str]:
    """Text to count tokens over: a ``.jsonl`` file's records or a ``.json`` file's array
    (every string in each record, nested ones too), or any other file whole as text.
    Evaluation sets are refused: a ranking tuned on them would flatter every benchmark."""
    from specdec.errors import DataError
    from specdec.prompts import refuse_eval_set

    for path in paths:
        refuse_eval_set(path)
        if not path.is_file():
            raise DataError(f"{path} does not exist")
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".jsonl":
            for lineno, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        yield from _strings(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        elif path.suffix == ".json":
            try:
                yield from _strings(json.loads(text))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e.msg})") from None
        else:
            yield text


def _strings(obj: object) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value)


def ranking_from_counts(counts: np.ndarray, keep: int = RANKING_TOKENS) -> np.ndarray:
    """Token ids by falling count, ties by id (deterministic), the first ``keep``."""
    order = np.lexsort((np.arange(len(counts)), -counts))
    return order[: min(keep, len(order))].astype(np.uint32)


def save_ranking(tokenizer: object, ranking: np.ndarray, directory: Path | None = None) -> Path:
    """Write a ranking (little-endian uint32 ids) where :func:`load_ranking` finds it (the
    cache), or into ``directory`` under the same name (to ship it: ``speculators/vocab``)."""
    path = ranking_paths(tokenizer)[0]
    if directory is not None:
        path = directory / path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(ranking.astype("<u4").tobytes())
    tmp.replace(path)
    return path


def load_ranking(tokenizer: object) -> np.ndarray | None:
    """The ranking for this tokenizer (cache, then shipped), or ``None``."""
    for path in ranking_paths(tokenizer):
        if path.is_file():
            return np.frombuffer(path.read_bytes(), dtype="<u4").astype(np.int64)
    return None


ROW_MULTIPLE = 64  # low-bit kernels pack output channels in blocks (int4: 16)


def draft_vocabulary(
    tokenizer: object, size: int, vocab_size: int, keep: Iterable[int] = ()
) -> torch.Tensor:
    """The ``size`` most frequent token ids plus ``keep`` (the special tokens: a chat answer's
    end must be draftable), topped up from the ranking to a multiple of ``ROW_MULTIPLE``, sorted.
    A clear error where no ranking exists for the tokenizer."""
    ranking = load_ranking(tokenizer)
    if ranking is None:
        raise ConfigError(
            "draft: vocab= needs a token-frequency ranking for this tokenizer, and none is "
            "shipped or cached; count one over text like your traffic with `specdec calibrate "
            "vocab --model DRAFT FILE...`, or drop vocab= (the full vocabulary)"
        )
    ranked = [int(i) for i in ranking if i < vocab_size]
    ids = set(ranked[:size])
    ids.update(int(i) for i in keep if 0 <= int(i) < vocab_size)
    rest = iter(ranked[size:])
    while len(ids) % ROW_MULTIPLE and len(ids) < vocab_size:
        nxt = next(rest, None)
        if nxt is None:  # the ranking ran out: any unused id pads the head
            nxt = next(i for i in range(vocab_size) if i not in ids)
        ids.add(nxt)
    return torch.tensor(sorted(ids), dtype=torch.long)


MAX_EXTRA = 4096  # context tokens outside the kept set scored besides it, at most


class SubsetHead(nn.Module):
    """An LM head over a subset of the vocabulary; the other logits are ``-inf``.

    ``head`` maps hidden states to the subset's logits (any linear module: a low-bit one keeps
    the draft's numerics); the output has the full vocabulary's width, so everything downstream
    (argmax, q rows for the sampling rule, top-k children) is unchanged.

    With ``rows`` (the full ``[V, hidden]`` output weight, e.g. a tied input embedding that the
    model keeps anyway, or a function from token ids to those rows: a quantised head dequantises
    just the rows asked for), tokens of the request's context outside the subset are scored too
    (:meth:`include`): a summary or a translation copies names and rare words from its prompt,
    which a frequency ranking misses (on the Qwen pair the top 32 k tokens cover fewer of a
    summary's tokens than of answers overall: experiments/draft-model/2026-12-03-draft-vocab.md)."""

    ids: torch.Tensor  # a buffer: moves with the module

    def __init__(
        self,
        head: nn.Module,
        ids: torch.Tensor,
        vocab_size: int,
        rows: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("ids", ids, persistent=False)
        self.vocab_size = vocab_size  # (no in/out_features: weight counters read the head's)
        self.rows = rows
        self._kept = set(ids.tolist())
        self._extra: list[int] = []
        self._extra_ids = ids.new_zeros(0)
        self._extra_rows: torch.Tensor | None = None

    def include(self, tokens: Iterable[int]) -> None:
        """Score these tokens too (context tokens outside the subset); a no-op without
        ``rows``. Extras accumulate up to ``MAX_EXTRA``, then start over from these."""
        if self.rows is None:
            return
        new = {t for t in tokens if t not in self._kept and 0 <= t < self.vocab_size}
        new.difference_update(self._extra)
        if not new:
            return
        if len(self._extra) + len(new) > MAX_EXTRA:
            self._extra = []
        self._extra = [*self._extra, *sorted(new)][:MAX_EXTRA]
        self._extra_ids = torch.tensor(self._extra, dtype=torch.long, device=self.ids.device)
        if isinstance(self.rows, torch.Tensor):
            self._extra_rows = self.rows.index_select(0, self._extra_ids)  # [E, hidden]
        else:
            self._extra_rows = self.rows(self._extra_ids)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        part = self.head(hidden)  # [..., N]
        out = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        out.index_copy_(-1, self.ids, part)
        if self._extra_rows is not None:
            extra = hidden.to(self._extra_rows.dtype) @ self._extra_rows.T  # [..., E]
            out.index_copy_(-1, self._extra_ids, extra.to(out.dtype))
        return out


def with_subset_head(model: PreTrainedModel, ids: torch.Tensor, dtype_name: str) -> PreTrainedModel:
    """A view of ``model`` whose LM head scores only ``ids``: every other submodule (and so
    every weight) is shared with ``model``, which is left as it was (another speculator may
    draft with its full head)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError("draft: vocab= needs a model with an output embedding (LM head)")
    device = next(iter(model.parameters())).device
    select = getattr(head, "select_rows", None)
    if callable(select):  # a head in a GGUF file's own blocks: keep the chosen rows' blocks
        vocab_size = int(head.out_features)
        # extras are scored in float32 from the head's own rows, dequantised as the file does
        subset = SubsetHead(select(ids), ids.to(device), vocab_size, head.exact_rows)
    else:
        subset = _dense_subset_head(model, head, ids, dtype_name, device)
    view = object.__new__(type(model))
    view.__dict__ = dict(model.__dict__)
    view._modules = dict(model._modules)  # its own module table: the head differs, nothing else
    view.set_output_embeddings(subset)
    return view


def _dense_subset_head(
    model: PreTrainedModel,
    head: nn.Module,
    ids: torch.Tensor,
    dtype_name: str,
    device: torch.device,
) -> SubsetHead:
    """The subset head of a float (or repacked low-bit) head: its rows copied out in float32,
    then converted to the draft's numerics ``dtype_name``."""
    from specdec.target.numerics import dense_weight, linear_like

    vocab_size = int(getattr(head, "out_features", 0)) or int(model.config.vocab_size)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):  # a swapped (prepacked, low-bit) head: fp32
        weight = dense_weight(head)  # [V, hidden]
    bias = getattr(head, "bias", None)
    sub = nn.Linear(
        weight.shape[1], len(ids), bias=isinstance(bias, torch.Tensor), dtype=weight.dtype
    )
    with torch.no_grad():
        sub.weight.copy_(weight.index_select(0, ids.to(weight.device)))
        if isinstance(bias, torch.Tensor):
            sub.bias.copy_(bias.detach().index_select(0, ids.to(bias.device)))
    hidden = sub.in_features
    del weight  # a low-bit head's dense copy is large (544 MB for Qwen's 151,936 x 896)
    rows = None
    embedding = getattr(model.get_input_embeddings(), "weight", None)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied and isinstance(embedding, torch.Tensor):
        if tuple(embedding.shape) == (vocab_size, hidden):
            rows = embedding.detach()  # the head's own rows, held by the model anyway
    return SubsetHead(linear_like(sub, dtype_name, device), ids.to(device), vocab_size, rows)
