"""SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975): model-free tree drafts from a suffix
index over this request's prompt and output and over the outputs of earlier requests.

Each step matches the longest suffix of the context (up to ``max_depth`` tokens) in both
indexes and drafts a tree of the continuations that followed it, scored by frequency (a node's
probability is the product of count(child) / count(parent) along its path; the most probable
nodes are taken greedily). A match of p tokens may draft ``min(max_spec_tokens, alpha * p)``
nodes, so long matches (repeated code, templated or agentic answers) draft aggressively and
short, ambiguous ones barely at all. Of all candidate trees, the one with the highest score
(expected accepted tokens) wins. Drafts are deterministic (q = one-hot, siblings distinct), so
tree verification keeps greedy and sampled output exactly the target's.

The global cache (:class:`SuffixCache`) learns across requests: each finished request adds its
output; it is bounded (oldest documents evicted first), thread-safe, and can be persisted.

Costs: a lookup is a few binary searches over a suffix array (microseconds, far below a
target step); adding an output is one binary search per token and one memmove; loading a saved
cache is one bulk sort. Memory is 16 bytes per cached token (int32 corpus, int32 sorted
positions, int64 two-token keys), about three times that during an insertion. Measured costs:
``docs/methods.md``. See ``suffix_index`` for the data structure.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from specdec.errors import CheckpointError, ConfigError
from specdec.speculators.base import DraftContext, Feedback, Speculator
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.speculators.suffix_index import Proposal, SuffixIndex, best_proposal
from specdec.target import LoadedModel
from specdec.tree import DraftTree

FORMAT = "specdec-suffix-cache"
VERSION = 1
DEFAULT_MAX_TOKENS = 250_000
DEFAULT_MAX_DEPTH = 32


class SuffixCache:
    """The global index over earlier requests' outputs: bounded, thread-safe, persistable.

    Each finished request is stored as its output preceded by up to ``max_depth`` tokens of its
    prompt as left context. Only positions whose continuation is model output count (the last
    prompt token, then the output): prompt text is user-written and would skew the frequencies
    towards text the model does not produce, and the current prompt is already in the
    per-request index. The left context still lets a new prompt's ending match the point where
    an earlier answer began, so a repeated (or agentic, templated) prompt drafts the earlier
    answer from its very first step.

    Once more than ``max_tokens`` tokens are stored the oldest documents are evicted, which
    removes their occurrences from every count. Several engines and threads may share one
    cache: every method takes the cache's lock.
    """

    def __init__(
        self, max_tokens: int = DEFAULT_MAX_TOKENS, max_depth: int = DEFAULT_MAX_DEPTH
    ) -> None:
        if max_tokens < 1:
            raise ConfigError(f"the suffix cache needs max_tokens >= 1, got {max_tokens}")
        if max_depth < 1:
            raise ConfigError(f"the suffix cache needs max_depth >= 1, got {max_depth}")
        self.max_tokens = max_tokens
        self.max_depth = max_depth
        self._index = SuffixIndex(max_depth)
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return self._index.num_tokens

    @property
    def num_documents(self) -> int:
        with self._lock:
            return self._index.num_documents

    def add(self, output: Sequence[int], context: Sequence[int] = ()) -> None:
        """Store one request's ``output`` with the end of its prompt (``context``) as left
        context, then evict the oldest documents until at most ``max_tokens`` remain."""
        if not output:
            return
        left = list(context[-self.max_depth :]) if self.max_depth else []
        doc = left + list(output)
        if len(doc) > self.max_tokens:  # a document larger than the whole cache: keep its start
            doc = doc[: self.max_tokens]
        with self._lock:
            self._index.add_document(doc, context_len=len(left))
            excess = self._index.num_tokens - self.max_tokens
            while excess > 0:
                excess -= self._index.evict_oldest(1)

    def best(
        self,
        context: Sequence[int],
        max_nodes_for: Callable[[int], int],
        *,
        min_match_length: int,
        min_prob: float,
        max_occurrences: int,
        bound: float = 0.0,
    ) -> Proposal | None:
        """:func:`best_proposal` over this cache, under its lock."""
        with self._lock:
            return best_proposal(
                self._index,
                context,
                max_nodes_for,
                min_match_length=min_match_length,
                min_prob=min_prob,
                max_occurrences=max_occurrences,
                bound=bound,
            )

    def count(self, pattern: Sequence[int]) -> int:
        with self._lock:
            return self._index.count(pattern)

    # -- persistence -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the stored documents and settings to a safetensors file, atomically (a
        temporary file in the same directory, then ``os.replace``), so a reader or a crash
        never sees half a cache."""
        from safetensors.numpy import save_file

        with self._lock:
            tokens, lengths, contexts = self._index.snapshot()
        tensors = {"tokens": tokens, "lengths": lengths, "context_lengths": contexts}
        meta = {
            "format": FORMAT,
            "version": str(VERSION),
            "config": json.dumps({"max_tokens": self.max_tokens, "max_depth": self.max_depth}),
        }
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache is meant to be shared
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str], max_tokens: int | None = None) -> SuffixCache:
        """Read a file written by :meth:`save` and rebuild the index (one bulk sort).
        ``max_tokens`` overrides the saved cap (the oldest documents beyond it are dropped).
        Raises :class:`CheckpointError` naming the file if it is unreadable or not a cache."""
        from safetensors import SafetensorError, safe_open

        where = Path(path)
        try:
            with safe_open(str(where), framework="np") as f:
                meta = f.metadata() or {}
                arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(
                f"cannot read the suffix cache {where} (truncated or corrupt? delete it to start "
                f"afresh): {e}"
            ) from e
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise CheckpointError(
                f"{where} is not a specdec suffix cache (version {VERSION}); delete it or pass "
                "another file"
            )
        try:
            config = json.loads(meta["config"])
            saved_cap, depth = int(config["max_tokens"]), int(config["max_depth"])
            tokens, lengths = arrays["tokens"], arrays["lengths"]
            contexts = arrays["context_lengths"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where} lacks part of a suffix cache: {e}") from e
        if (
            saved_cap < 1
            or depth < 1
            or tokens.ndim != 1
            or tokens.dtype != np.int32
            or lengths.dtype != np.int64
            or contexts.dtype != np.int64
            or lengths.shape != contexts.shape
            or int(lengths.sum()) != len(tokens)
            or (len(tokens) and int(tokens.min()) < 0)
            or bool((lengths < 0).any() or (contexts < 0).any() or (contexts > lengths).any())
        ):
            raise CheckpointError(f"{where}: inconsistent suffix cache (corrupt?)")
        cache = cls(max_tokens if max_tokens is not None else saved_cap, depth)
        cache._restore(tokens, lengths.tolist(), contexts.tolist())
        return cache

    def _restore(self, tokens: np.ndarray, lengths: list[int], contexts: list[int]) -> None:
        """Keep the newest documents that fit, then index them in one bulk sort."""
        keep, total = len(lengths), 0
        while keep > 0 and total + lengths[keep - 1] <= self.max_tokens:
            keep -= 1
            total += lengths[keep]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        index = SuffixIndex(self.max_depth)
        index.load_documents(
            [
                (tokens[offsets[i] : offsets[i + 1]].tolist(), contexts[i])
                for i in range(keep, len(lengths))
            ]
        )
        with self._lock:
            self._index = index


class SuffixSpeculator(Speculator):
    """SuffixDecoding drafts: a per-request index plus a (possibly shared) global cache.

    Knobs (defaults after the paper and its reference deployment, ArcticInference):
    ``max_depth`` 32 tokens of context matched; ``alpha`` 1.0 drafted nodes per matched token,
    capped at ``max_spec_tokens`` 32 (so a full-depth match drafts the cap); ``min_match_length``
    2 (a single shared token says little and would draft on most steps); ``min_token_prob`` 0.1
    (nodes whose estimated acceptance probability is lower cost more to verify than they are
    expected to return); ``max_occurrences`` 64 (frequencies of very common patterns are
    estimated from 64 evenly spread occurrences, which bounds a step's cost).

    One speculator serves one request at a time (the engine's loop); to share what was
    learned, give several speculators the same ``cache``. With ``cache_path`` set, the cache is
    saved there at the end of every request (a few ms for the default cap).
    """

    name: ClassVar[str] = "suffix"
    drafts_trees: ClassVar[bool] = True

    def __init__(
        self,
        cache: SuffixCache | None = None,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_spec_tokens: int = 32,
        alpha: float = 1.0,
        min_match_length: int = 2,
        min_token_prob: float = 0.1,
        max_occurrences: int = 64,
        cache_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_depth < 1 or max_spec_tokens < 1 or max_occurrences < 1:
            raise ConfigError(
                "suffix decoding needs max_depth, max_spec_tokens and max_occurrences >= 1"
            )
        if not alpha > 0 or not 0.0 <= min_token_prob <= 1.0 or min_match_length < 1:
            raise ConfigError(
                "suffix decoding needs alpha > 0, 0 <= min_token_prob <= 1 and "
                f"min_match_length >= 1; got {alpha}, {min_token_prob}, {min_match_length}"
            )
        self.cache = cache if cache is not None else SuffixCache(max_depth=max_depth)
        self.max_depth = max_depth
        self.max_spec_tokens = max_spec_tokens
        self.alpha = alpha
        self.min_match_length = min_match_length
        self.min_token_prob = min_token_prob
        self.max_occurrences = max_occurrences
        self.cache_path = None if cache_path is None else Path(cache_path)
        self.reset()

    def reset(self) -> None:
        """Start a new request: a fresh per-request index; the global cache is kept."""
        self._local = SuffixIndex(self.max_depth)
        self._seen = 0  # tokens of the request already in the per-request index

    def _sync(self, tokens: list[int]) -> None:
        if len(tokens) < self._seen:  # context shrank: a new request without reset()
            self.reset()
        if self._seen == 0:
            self._local.add_document(tokens, open=True)
        else:
            self._local.extend(tokens[self._seen :])
        self._seen = len(tokens)

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        """The best-scoring tree of either index; the root alone when nothing matches.

        >>> import torch
        >>> from specdec.config import SamplingConfig
        >>> spec = SuffixSpeculator(min_match_length=1)
        >>> spec.cache.add([5, 6, 7, 8], context=[1, 2])   # an earlier answer to "... 1 2"
        >>> ctx = DraftContext([9, 1, 2], 3, SamplingConfig(), torch.Generator())
        >>> spec.propose(ctx, budget=10).tokens           # match "1 2": alpha * 2 = 2 nodes
        (2, 5, 6)
        """
        tokens = context.tokens
        root = tokens[-1]
        self._sync(tokens)
        cap = min(self.max_spec_tokens, budget)
        if cap < 1:
            return DraftTree.root_only(root)

        def max_nodes_for(match_length: int) -> int:
            return min(cap, math.floor(self.alpha * match_length))

        best = best_proposal(
            self._local,
            tokens,
            max_nodes_for,
            min_match_length=self.min_match_length,
            min_prob=self.min_token_prob,
            max_occurrences=self.max_occurrences,
        )
        shared = self.cache.best(
            tokens,
            max_nodes_for,
            min_match_length=self.min_match_length,
            min_prob=self.min_token_prob,
            max_occurrences=self.max_occurrences,
            bound=best.score if best is not None else 0.0,
        )
        best = shared or best
        if best is None:
            return DraftTree.root_only(root)
        return DraftTree(tokens=(root, *best.tokens), parents=(-1, *best.parents))

    def observe(self, feedback: Feedback) -> None:
        pass  # the next propose() reads the committed tokens from its context

    def end_request(self, tokens: list[int], prompt_len: int) -> None:
        """Add the finished request's output to the global cache (see :class:`SuffixCache`
        for why the prompt only serves as left context) and save the cache if configured."""
        self.cache.add(tokens[prompt_len:], context=tokens[:prompt_len])
        if self.cache_path is not None and len(tokens) > prompt_len:
            self.cache.save(self.cache_path)


@dataclass(frozen=True, kw_only=True)
class SuffixOptions(SpeculatorOptions):
    """The knobs of :class:`SuffixSpeculator` (defaults after the paper); ``cache`` is a file
    loaded at start and saved after every request, so earlier outputs survive restarts."""

    primary = "cache"
    cache: str | None = option(
        None, help="file the cache of earlier outputs is loaded from and saved to"
    )
    max_depth: int = option(DEFAULT_MAX_DEPTH, help="tokens of context matched")
    max_spec_tokens: int = option(32, help="most drafted nodes")
    alpha: float = option(1.0, help="drafted nodes per matched token")
    min_match_length: int = option(2, help="shortest match that drafts")
    min_token_prob: float = option(0.1, help="nodes less likely to be accepted are not drafted")
    max_occurrences: int = option(64, help="occurrences sampled to estimate frequencies")

    def __post_init__(self) -> None:
        super().__post_init__()
        SuffixSpeculator(**self.knobs())  # the speculator's own range checks, before any work

    def knobs(self) -> dict[str, Any]:
        return {
            "max_depth": self.max_depth,
            "max_spec_tokens": self.max_spec_tokens,
            "alpha": self.alpha,
            "min_match_length": self.min_match_length,
            "min_token_prob": self.min_token_prob,
            "max_occurrences": self.max_occurrences,
        }


@register("suffix", SuffixOptions)
def _build(target: LoadedModel, options: SuffixOptions) -> SuffixSpeculator:
    """SuffixDecoding: trees from suffix indexes of this request and of earlier outputs"""
    path = options.cache
    cache = SuffixCache.load(path) if path is not None and Path(path).is_file() else None
    return SuffixSpeculator(cache, cache_path=path, **options.knobs())
