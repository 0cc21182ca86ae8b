"""DraftTree: the single draft type every speculator returns and every verifier consumes.

Node 0 is the root, the last committed token (already sampled, not yet in the target's KV cache).
Every other node is a drafted token whose parent precedes it (``parents[i] < i``). A chain of K
drafts is the tree with parents ``[-1, 0, 1, ..., K-1]``; an empty draft is the root alone, which
makes plain decoding the same loop with nothing drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A tree of drafted tokens rooted at the last committed token.

    Attributes:
        tokens: token id of every node, ``tokens[0]`` the root.  # [N]
        parents: parent index of every node, ``parents[0] == -1``.  # [N]
        draft_probs: q, the draft distribution each node was sampled from (row i is the
            distribution over node i's token given its ancestors; row 0 is unused). ``None`` for
            deterministic drafts, which the acceptance rules treat as q = one-hot.  # [N, V]
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) == 0:
            raise ValueError("a DraftTree needs at least the root node")
        if len(self.tokens) != len(self.parents):
            raise ValueError(
                f"tokens ({len(self.tokens)}) and parents ({len(self.parents)}) differ in length"
            )
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parents[0] == -1)")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents[{i}] = {p} must satisfy 0 <= parent < {i}")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs must have one row per node")

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def root_only(cls, root: int) -> DraftTree:
        """The empty draft: verification then is one plain decoding step."""
        return cls(tokens=(int(root),), parents=(-1,))

    @classmethod
    def chain(
        cls, root: int, drafts: list[int] | tuple[int, ...], draft_probs: torch.Tensor | None = None
    ) -> DraftTree:
        """A linear draft ``root -> d1 -> d2 ...``.

        >>> DraftTree.chain(7, [3, 4]).parents
        (-1, 0, 1)
        """
        n = len(drafts) + 1
        return cls(
            tokens=(int(root), *(int(t) for t in drafts)),
            parents=tuple(range(-1, n - 1)),
            draft_probs=draft_probs,
        )

    def truncated(self, drafts: int) -> DraftTree:
        """The first ``drafts`` drafted nodes with the root: a tree again, since every node's
        parent precedes it (q rows cut alike).

        >>> DraftTree(tokens=(1, 2, 3, 4), parents=(-1, 0, 0, 1)).truncated(2).parents
        (-1, 0, 0)
        """
        if drafts >= self.num_drafted:
            return self
        n = drafts + 1
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        return DraftTree(tokens=self.tokens[:n], parents=self.parents[:n], draft_probs=probs)

    # -- derived structure ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node, the root at depth 0.

        >>> DraftTree(tokens=(1, 2, 3, 4), parents=(-1, 0, 0, 1)).depths
        (0, 1, 1, 2)
        """
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node in index order.

        >>> DraftTree(tokens=(1, 2, 3, 4), parents=(-1, 0, 0, 1)).children
        ((1, 2), (3,), (), ())
        """
        kids: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """Absolute positions: the committed prefix occupies ``[0, prefix_len)``.  # [N]"""
        return torch.tensor(self.depths, dtype=torch.long) + prefix_len

    def ancestor_mask(self) -> torch.Tensor:
        """``mask[i, j]`` is True when node j is node i itself or one of its ancestors.  # [N, N]

        >>> DraftTree(tokens=(1, 2, 3), parents=(-1, 0, 0)).ancestor_mask().int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
        """
        n = len(self.parents)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive.

        >>> DraftTree(tokens=(1, 2, 3, 4), parents=(-1, 0, 0, 2)).path_to(3)
        [0, 2, 3]
        """
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
