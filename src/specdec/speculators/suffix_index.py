"""A compact suffix index over token documents, and the frequency-scored draft-tree search of
SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975), as pure data structures and functions.

The paper keeps a suffix tree whose node for a string s counts the occurrences of s; a node's
children are the tokens that followed s, with probability count(s + t) / count(s). A Python
trie with one object per node would need hundreds of bytes per node and about depth × tokens
nodes (gigabytes for a few hundred thousand tokens), so this index stores the same information
as a sorted array instead:

* ``corpus`` holds every document preceded by ``max_depth`` sentinels (-1), as int32;
* ``sa`` holds, for every indexed position j, j itself, sorted by the reversed string ending at
  j (``corpus[j], corpus[j-1], ...``, ``max_depth`` tokens, the sentinels sorting first).

All occurrences of a pattern ending at some j then form one contiguous run of ``sa``, and the
run for the pattern's last p tokens contains the run for its last p + 1 tokens, so the longest
suffix match of the context is found by narrowing one run, one token (two bisections) at a time.
The children of a trie node are read forward from the run's occurrences (``corpus[j + 1]``),
which gives exactly the trie's counts. Memory: 16 bytes per indexed token (corpus, ``sa`` and
an int64 ``head`` key per entry, the first two tokens, which makes the big runs of lengths 1
and 2 a C-speed bisection) plus ``4 * max_depth`` bytes per document; insertions keep ``sa``
sorted (binary search + memmove), evictions cut whole documents from the front and filter
``sa`` (numpy, O(tokens)).
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

SENTINEL = -1  # precedes every document; sorts before every token


@dataclass(frozen=True)
class Match:
    """The last ``length`` context tokens occur ``hi - lo`` times: at ``sa[lo:hi]``."""

    length: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Proposal:
    """A draft tree below the root: ``parents`` index the root as 0 and ``tokens[i]`` as i + 1.
    ``score`` is the sum of the nodes' path probabilities, the expected number of accepted
    tokens if the index's frequencies were the target's."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    score: float
    match_length: int


def _head_key(last: int, before: int) -> int:
    """The reversed string's first two tokens as one sortable int64 (sentinel -1 -> 0)."""
    return ((last + 1) << 32) | (before + 1)


def _int32s(a: np.ndarray) -> array:
    return array("i", a.astype(np.int32, copy=False).tobytes())


def _int64s(a: np.ndarray) -> array:
    return array("q", a.astype(np.int64, copy=False).tobytes())


def _reversed_ranks(corpus: np.ndarray, depth: int) -> np.ndarray:
    """Dense rank of the reversed string ``corpus[j], corpus[j-1], ...`` of ``depth`` tokens
    ending at every j (positions before 0 read as sentinels), by prefix doubling: the rank for
    length m <= 2k is the pair (rank_k(j), rank_k(j - (m - k))), whose windows overlap.

    >>> _reversed_ranks(np.array([-1, 2, 1, 2, 1], dtype=np.int32), 2).tolist()
    [0, 2, 1, 3, 1]
    """
    rank = corpus.astype(np.int64) + 1
    idx = np.arange(len(corpus))
    k = 1
    while k < depth:
        shift = min(k, depth - k)
        second = rank[np.maximum(idx - shift, 0)]
        second[idx < shift] = 0  # before the corpus: all sentinels, the smallest string
        pair = (rank << 32) | second  # dense ranks < 2**31: one sortable int64
        order = np.argsort(pair)
        ordered = pair[order]
        new = np.empty_like(rank)
        new[order] = np.concatenate([[0], np.cumsum(ordered[1:] != ordered[:-1])])
        rank = new
        k += shift
    return rank


def _offset_key(corpus: array, offset: int) -> Callable[[int], int]:
    def key(j: int) -> int:
        return corpus[j - offset]

    return key


class SuffixIndex:
    """Documents of tokens, searchable by the longest suffix of a context (not thread-safe).

    >>> index = SuffixIndex(max_depth=4)
    >>> index.add_document([1, 2, 3, 1, 2, 4])
    >>> index.count([1, 2]), index.count([2, 3]), index.count([5])
    (2, 1, 0)
    >>> [(m.length, m.count) for m in index.match([7, 1, 2])]   # "2" twice, "1 2" twice
    [(1, 2), (2, 2)]
    """

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.corpus = array("i")  # sentinels + documents
        self.sa = array("i")  # indexed positions, sorted by the reversed string ending there
        self.head = array("q")  # per sa entry, its first two tokens as one int64 (_head_key)
        # per document: (stored tokens, left-context tokens); the last may still be open
        self._docs: deque[tuple[int, int]] = deque()
        self._open = False  # the last document may grow; its final token is not indexed
        self._tokens = 0

    # -- size ----------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens stored in documents (left context included, sentinels not)."""
        return self._tokens

    @property
    def num_documents(self) -> int:
        return len(self._docs)

    def documents(self) -> list[tuple[list[int], int]]:
        """Every document as ``(tokens, context_len)``, oldest first."""
        out, start = [], 0
        for length, context in self._docs:
            start += self.max_depth
            out.append((self.corpus[start : start + length].tolist(), context))
            start += length
        return out

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, lengths, context_lens)``: every document's tokens concatenated (int32),
        oldest first, for saving; a copy, so it stays valid after the index changes."""
        corpus = np.frombuffer(self.corpus, dtype=np.int32)
        tokens = corpus[corpus != SENTINEL].copy()  # tokens are >= 0, sentinels -1
        lengths = np.array([n for n, _ in self._docs], dtype=np.int64)
        contexts = np.array([c for _, c in self._docs], dtype=np.int64)
        return tokens, lengths, contexts

    # -- insertion -----------------------------------------------------------------------------
    def add_document(
        self, tokens: Sequence[int], context_len: int = 0, *, open: bool = False
    ) -> None:
        """Append a document. Its first ``context_len`` tokens are left context only: they can
        be matched, but no occurrence ends inside them except at the last one (whose
        continuation is the document proper). An ``open`` document may grow with
        :meth:`extend`; its final token stays unindexed until another follows, since a query
        always ends at the final token and must not match itself."""
        self._close()
        if not 0 <= context_len <= len(tokens):
            raise ValueError(f"context_len {context_len} outside [0, {len(tokens)}]")
        self.corpus.extend([SENTINEL] * self.max_depth)
        start = len(self.corpus)
        self.corpus.extend(tokens)
        self._docs.append((len(tokens), context_len))
        self._tokens += len(tokens)
        self._open = open
        first = start + max(0, context_len - 1)
        self._index(range(first, len(self.corpus) - (1 if open else 0)))

    def load_documents(self, docs: Sequence[tuple[Sequence[int], int]]) -> None:
        """Append closed documents ``(tokens, context_len)`` and index them in one bulk sort
        (what loading a saved cache needs: one insertion at a time would cost a memmove each)."""
        self._close()
        new: list[np.ndarray] = []
        for tokens, context_len in docs:
            if not 0 <= context_len <= len(tokens):
                raise ValueError(f"context_len {context_len} outside [0, {len(tokens)}]")
            self.corpus.extend([SENTINEL] * self.max_depth)
            start = len(self.corpus)
            self.corpus.extend(tokens)
            self._docs.append((len(tokens), context_len))
            self._tokens += len(tokens)
            new.append(np.arange(start + max(0, context_len - 1), len(self.corpus)))
        if new:
            self._rebuild(np.concatenate(new).astype(np.int64))

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the open document (see :meth:`add_document`)."""
        if not self._open:
            raise ValueError("extend() needs an open document")
        if not tokens:
            return
        before = len(self.corpus)
        self.corpus.extend(tokens)
        length, context = self._docs[-1]
        self._docs[-1] = (length + len(tokens), context)
        self._tokens += len(tokens)
        first = max(before - 1, self._first_indexable())
        self._index(range(first, len(self.corpus) - 1))

    def _first_indexable(self) -> int:
        """Position of the last document's first occurrence end (see :meth:`add_document`)."""
        length, context = self._docs[-1]
        return len(self.corpus) - length + max(0, context - 1)

    def _close(self) -> None:
        if self._open:
            self._open = False
            last = len(self.corpus) - 1
            if last >= self._first_indexable() and self._docs[-1][0] > 0:
                self._index(range(last, last + 1))

    def _key(self, j: int) -> array:
        return self.corpus[j : j - self.max_depth : -1]

    def _head(self, j: int) -> int:
        return _head_key(self.corpus[j], self.corpus[j - 1])

    def _index(self, positions: range) -> None:
        if len(positions) > max(256, len(self.sa) // 4):
            self._rebuild(np.arange(positions.start, positions.stop, dtype=np.int64))
        elif len(positions) <= 8:
            for j in positions:
                i = self._insertion_point(j)
                self.sa.insert(i, j)
                self.head.insert(i, self._head(j))
        else:  # find every insertion point, then move the arrays once
            new = sorted(positions, key=self._key)
            where = [self._insertion_point(j) for j in new]
            sa = np.insert(np.frombuffer(self.sa, dtype=np.int32), where, new)
            head = np.insert(
                np.frombuffer(self.head, dtype=np.int64), where, [self._head(j) for j in new]
            )
            self.sa, self.head = _int32s(sa), _int64s(head)

    def _insertion_point(self, j: int) -> int:
        """Where ``j`` goes in ``sa``: bisect the head keys (C speed), then the full reversed
        strings inside the run of equal heads."""
        h = self._head(j)
        lo = bisect_left(self.head, h)
        hi = bisect_right(self.head, h, lo)
        if hi == lo:
            return lo
        return bisect_right(self.sa, self._key(j), lo, hi, key=self._key)

    def _rebuild(self, new: np.ndarray) -> None:
        """Sort all indexed positions at once, for bulk inserts and loading a saved cache (one
        insertion at a time costs a memmove each). Ranks of the reversed strings ending at each
        position are refined by prefix doubling, about log2(max_depth) numpy sorts."""
        corpus = np.frombuffer(self.corpus, dtype=np.int32)
        pos = np.concatenate([np.frombuffer(self.sa, dtype=np.int32).astype(np.int64), new])
        rank = _reversed_ranks(corpus, self.max_depth)
        pos = pos[np.argsort(rank[pos], kind="stable")]
        c = corpus.astype(np.int64) + 1
        self.sa = _int32s(pos)
        self.head = _int64s((c[pos] << 32) | c[pos - 1])

    # -- eviction ------------------------------------------------------------------------------
    def evict_oldest(self, n: int = 1) -> int:
        """Drop the ``n`` oldest documents and every occurrence inside them; return the number of
        tokens freed. Counts of every pattern they contained fall accordingly, and patterns only
        they contained disappear."""
        n = min(n, len(self._docs))
        if n == 0:
            return 0
        cut, freed = 0, 0
        for _ in range(n):
            length, _context = self._docs.popleft()
            cut += self.max_depth + length
            freed += length
        if not self._docs:
            self._open = False
        del self.corpus[:cut]
        sa = np.frombuffer(self.sa, dtype=np.int32)
        keep = sa >= cut
        self.sa = _int32s(sa[keep] - cut)
        self.head = _int64s(np.frombuffer(self.head, dtype=np.int64)[keep])
        self._tokens -= freed
        return freed

    # -- queries -------------------------------------------------------------------------------
    def match(self, context: Sequence[int], min_length: int = 1) -> list[Match]:
        """Runs of ``sa`` for every suffix of ``context`` that occurs, from length
        ``min_length`` up to the longest (at most ``max_depth``), shortest first.

        Cost: lengths 1 and 2 bisect the int64 head keys (C speed, the big runs); each longer
        length bisects the run on the single token it adds (the run agrees on the others), and
        once one occurrence is left the rest is a direct comparison.
        """
        corpus, sa = self.corpus, self.sa
        limit = min(self.max_depth, len(context))
        out: list[Match] = []
        if limit == 0 or not sa:
            return out
        first = context[-1] + 1
        lo = bisect_left(self.head, first << 32)
        hi = bisect_left(self.head, (first + 1) << 32, lo)
        p = 1
        if lo < hi and limit >= 2:
            h = (first << 32) | (context[-2] + 1)
            lo2 = bisect_left(self.head, h, lo, hi)
            hi2 = bisect_right(self.head, h, lo2, hi)
            if lo2 < hi2:
                if min_length <= 1:
                    out.append(Match(1, lo, hi))
                lo, hi, p = lo2, hi2, 2
        while hi > lo:
            if p >= min_length:
                out.append(Match(p, lo, hi))
            if p >= limit:
                break
            token = context[-1 - p]
            if hi - lo == 1:  # one candidate left: extend by direct comparison
                if corpus[sa[lo] - p] != token:
                    break
            else:
                key = _offset_key(corpus, p)
                new_lo = bisect_left(sa, token, lo, hi, key=key)
                new_hi = bisect_right(sa, token, new_lo, hi, key=key)
                if new_lo == new_hi:
                    break
                lo, hi = new_lo, new_hi
            p += 1
        return out

    def count(self, pattern: Sequence[int]) -> int:
        """How many times ``pattern`` occurs ending at an indexed position (the trie count of
        the node for ``pattern``); 0 if it is longer than ``max_depth``."""
        if not pattern or len(pattern) > self.max_depth:
            return 0
        matches = self.match(pattern, min_length=len(pattern))
        return matches[-1].count if matches else 0

    def occurrences(self, match: Match, limit: int) -> list[int]:
        """End positions of ``match``; more than ``limit`` are subsampled evenly over the run
        (frequencies estimated from ``limit`` occurrences keep a step's cost bounded)."""
        n = match.count
        if n <= limit:
            return self.sa[match.lo : match.hi].tolist()
        return [self.sa[match.lo + (i * n) // limit] for i in range(limit)]


def expand_tree(
    corpus: Sequence[int], ends: Sequence[int], max_nodes: int, min_prob: float
) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    """Greedy best-first draft tree over the continuations of the occurrences ``ends``.

    A node's path probability is the product of count(child) / count(parent) along its path;
    the tree takes the most probable node not yet taken, ``max_nodes`` times, skipping nodes
    below ``min_prob`` (SuffixDecoding's greedy expansion). Occurrences whose document ends
    count in the parent but in no child. Returns ``(tokens, parents, score)``, parents indexing
    the root as 0, score the sum of the taken nodes' probabilities.

    Worked example: after [9], the corpus continues with 1 2 (twice) and 1 3 (once):

    >>> corpus = [9, 1, 2, -1, 9, 1, 2, -1, 9, 1, 3, -1]
    >>> tokens, parents, score = expand_tree(corpus, [0, 4, 8], max_nodes=3, min_prob=0.1)
    >>> tokens, parents, round(score, 3)     # 1 (p=1), then 2 (p=2/3), then 3 (p=1/3)
    ((1, 2, 3), (0, 1, 1), 2.0)
    """
    size = len(corpus)
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    order = itertools.count()
    heap: list[tuple[float, int, int, int, list[int]]] = []

    def push_children(node: int, prob: float, positions: list[int]) -> None:
        groups: dict[int, list[int]] = {}
        for q in positions:
            if q < size:
                t = corpus[q]
                if t != SENTINEL:
                    group = groups.get(t)
                    if group is None:
                        groups[t] = [q + 1]
                    else:
                        group.append(q + 1)
        n = len(positions)
        for t, group in groups.items():
            child = prob * len(group) / n
            if child >= min_prob:
                heapq.heappush(heap, (-child, next(order), t, node, group))

    if max_nodes > 0 and ends:
        push_children(0, 1.0, [e + 1 for e in ends])
    while heap and len(tokens) < max_nodes:
        neg, _, t, parent, group = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        score -= neg
        if len(tokens) < max_nodes:
            push_children(len(tokens), -neg, group)
    return tuple(tokens), tuple(parents), score


def best_proposal(
    index: SuffixIndex,
    context: Sequence[int],
    max_nodes_for: Callable[[int], int],
    *,
    min_match_length: int,
    min_prob: float,
    max_occurrences: int,
    bound: float = 0.0,
) -> Proposal | None:
    """The best-scoring tree over every suffix match of ``context`` in ``index`` scoring above
    ``bound``, or None. A match of length p may draft ``max_nodes_for(p)`` nodes (grows with p:
    longer matches predict better). A tree's score cannot exceed its node count, so lengths
    whose cap cannot beat the best score so far are skipped, and of lengths with the same
    occurrences only the longest (largest cap) is scored.
    """
    best: Proposal | None = None
    last_run: tuple[int, int] | None = None
    for m in reversed(index.match(context, min_length=min_match_length)):
        if (m.lo, m.hi) == last_run:
            continue
        last_run = (m.lo, m.hi)
        cap = max_nodes_for(m.length)
        if cap <= bound:
            break  # shorter matches have smaller caps
        ends = index.occurrences(m, max_occurrences)
        tokens, parents, score = expand_tree(index.corpus, ends, cap, min_prob)
        if tokens and score > bound:
            best, bound = Proposal(tokens, parents, score, m.length), score
    return best
