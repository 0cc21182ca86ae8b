"""Grammar-constrained verification: prune a draft tree to the grammar, mask every node's
logits by the grammar state along its own path, and advance by what was committed.

The constrained target distribution at a position is p masked by the grammar state there and
renormalised (greedy: the argmax of the masked logits). Verification scores every tree node
against that masked distribution, so the acceptance rules stay exactly as they are and greedy
output equals constrained plain decoding, while sampled output follows the masked p.

A node's grammar state is its parent's state advanced by the node's token. One matcher walks
the tree depth first, consuming a child's token on the way down and rolling it back on the way
up, so siblings never see each other's tokens.

Pruning (before verification, so a draft the grammar forbids costs nothing) is lossless:

* a deterministic draft (q one-hot) the grammar forbids has p'(x) = 0 and would be rejected
  for sure, leaving p' unchanged; dropping it changes nothing;
* a sampled draft x ~ q that survives is, given that it survived, distributed as q restricted
  to the allowed set A and renormalised (q'); so the kept node's q row is replaced by q', and
  rejection sampling with q' reproduces p' on that event, while on the pruned event (no draft)
  the target samples p' directly. Both events yield p'. (Keeping q instead would be wrong: the
  residual norm(max(p' - q, 0)) would then be sampled with too little probability.)

Forced tokens: at a leaf, the tokens the grammar forces (``Matcher.forced_tokens``) are free to
draft; appended as a deterministic chain (q one-hot) they are accepted whenever the target
agrees, which costs one more tree node each and no drafting time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specdec.drafting import Feedback
from specdec.tree import DraftTree
from specdec.verify import Acceptance


class Matcher(Protocol):
    """A grammar engine's incremental matcher over one request's output tokens."""

    @property
    def vocab_size(self) -> int:
        """How many token ids the bitmask covers (ids at or above it are never allowed)."""
        ...

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out`` (int32 [ceil(vocab_size / 32)]), bit
        ``t % 32`` of word ``t // 32`` set when token t is allowed."""
        ...

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar forbids it."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        ...

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here, in order (often empty)."""
        ...


def bitmask_to_bool(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Unpack int32 bitmasks [N, W] into allowed flags [N, width] (columns past 32·W: False).

    Bit ``t % 32`` of word ``t // 32`` is token t: on a little-endian machine that is bit
    ``t % 8`` of byte ``t // 8``, which numpy unpacks in one pass (tens of µs for 49k tokens,
    where shifting in torch took milliseconds).

    >>> bitmask_to_bool(torch.tensor([[0b101]], dtype=torch.int32), 4).tolist()
    [[True, False, True, False]]
    """
    return torch.from_numpy(_allowed_np(bitmask, width))


def _allowed_np(bitmask: torch.Tensor, width: int) -> np.ndarray:
    n, words = bitmask.shape
    raw = bitmask.contiguous().numpy().view(np.uint8)  # [N, 4W]
    bits = np.unpackbits(raw, axis=1, bitorder="little").view(np.bool_)  # [N, 32W]
    if width <= words * 32:
        return bits[:, :width]
    return np.concatenate([bits, np.zeros((n, width - words * 32), dtype=np.bool_)], axis=1)


@dataclass
class ConstrainedTree:
    """One step's draft after the grammar saw it: ``tree`` (pruned, maybe extended by forced
    tokens) is what the target verifies; ``origin[i]`` is the index in the speculator's
    ``proposed`` tree of node i (-1 for a forced node the constraint added); ``bitmask``
    [N, W] the grammar state's allowed tokens at every node of ``tree``."""

    proposed: DraftTree
    tree: DraftTree
    origin: tuple[int, ...]
    bitmask: torch.Tensor  # [N, W] int32
    eos_token_ids: frozenset[int]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the constrained target: forbidden tokens at -inf, row by row."""
        allowed = _allowed_np(self.bitmask, logits.shape[-1])  # [N, V]
        empty = ~allowed.any(axis=1)  # a state with nothing allowed (an ended grammar): EOS
        if empty.any():
            allowed = allowed.copy()
            for eos in self.eos_token_ids:
                if eos < logits.shape[-1]:
                    allowed[empty, eos] = True
        # numpy's single-threaded select beats torch's intra-op pool on a [N, 49k] select
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
            x = logits.detach().numpy()
            return torch.from_numpy(np.where(allowed, x, x.dtype.type(-np.inf)))
        flags = torch.from_numpy(allowed).to(logits.device)
        return logits.masked_fill(~flags, float("-inf"))  # [N, V]

    def feedback(self, acceptance: Acceptance, logits: torch.Tensor) -> Feedback:
        """What the speculator hears, in terms of the tree it proposed: the accepted path
        mapped back to its nodes (up to the first node it did not propose), and the target's
        raw logits at its nodes (zeros where the grammar pruned a node)."""
        if len(self.origin) == len(self.proposed) and all(
            o == i for i, o in enumerate(self.origin)
        ):  # the same nodes (maybe with q' for q): the verified logits are its own
            return Feedback(self.proposed, acceptance, logits)
        path = []
        for node in acceptance.path:
            if self.origin[node] < 0:
                break
            path.append(self.origin[node])
        rows = torch.zeros(len(self.proposed), logits.shape[-1], dtype=logits.dtype)
        rows = rows.to(logits.device)
        kept = [i for i, o in enumerate(self.origin) if o >= 0]
        rows[[self.origin[i] for i in kept]] = logits[kept]
        mapped = Acceptance(tuple(path), acceptance.tokens)
        return Feedback(self.proposed, mapped, rows)


class GrammarConstraint:
    """The per-request constraint the engine applies between drafting, verification and commit
    (see the module docstring). ``max_forced`` caps the forced tokens added per step."""

    def __init__(
        self, matcher: Matcher, eos_token_ids: frozenset[int], *, max_forced: int = 16
    ) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.max_forced = max_forced
        self._words = (matcher.vocab_size + 31) // 32

    def prepare(self, tree: DraftTree, *, extend: bool = True) -> ConstrainedTree:
        """Prune ``tree`` to the grammar (and, with ``extend``, add forced tokens at leaves);
        compute every kept node's mask on the way. The matcher ends where it started."""
        m = self.matcher
        tokens: list[int] = [tree.tokens[0]]
        parents: list[int] = [-1]
        origin: list[int] = [0]
        masks: list[torch.Tensor] = []
        q_rows: list[int] = [0]  # row of tree.draft_probs per new node (-1: forced, one-hot)
        budget = self.max_forced if extend else 0

        def visit(old: int, new: int) -> None:
            nonlocal budget
            row = torch.empty(self._words, dtype=torch.int32)
            m.fill_mask(row)
            masks.append(row)
            children = tree.children[old] if old >= 0 else ()
            kept = 0
            for child in children:
                token = tree.tokens[child]
                if not _allowed(row, token) or not m.consume(token):
                    continue
                kept += 1
                tokens.append(token)
                parents.append(new)
                origin.append(child)
                q_rows.append(child)
                visit(child, len(tokens) - 1)
                m.rollback(1)
            if kept == 0 and budget > 0:
                forced = [t for t in m.forced_tokens() if t not in self.eos_token_ids]
                forced = forced[:budget]
                if forced and _allowed(row, forced[0]) and m.consume(forced[0]):
                    budget -= 1
                    tokens.append(forced[0])
                    parents.append(new)
                    origin.append(-1)
                    q_rows.append(-1)
                    visit(-1, len(tokens) - 1)  # its own forced tokens continue the chain
                    m.rollback(1)

        visit(0, 0)
        bitmask = torch.stack(masks)  # [N, W]
        same = len(tokens) == len(tree) and all(o == i for i, o in enumerate(origin))
        if same and tree.draft_probs is None:  # nothing pruned or added: the speculator's tree
            return ConstrainedTree(tree, tree, tuple(origin), bitmask, self.eos_token_ids)
        # (sampled drafts always get q': a draft that survived is distributed as q', also when
        # this step's drafts all happened to survive)
        probs = None
        if tree.draft_probs is not None:
            probs = _restricted_q(tree.draft_probs, q_rows, tokens, parents, bitmask)
        new = DraftTree(tuple(tokens), tuple(parents), probs)
        return ConstrainedTree(tree, new, tuple(origin), bitmask, self.eos_token_ids)

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (the step's accepted drafts and the target's token). An EOS the
        matcher does not take (the grammar has ended) is ignored: the request ends with it."""
        for token in tokens:
            if not self.matcher.consume(token) and token not in self.eos_token_ids:
                raise RuntimeError(
                    f"token {token} was committed although the grammar forbids it; this is a "
                    "bug in specdec's constrained verification, please report it"
                )


def _allowed(row: torch.Tensor, token: int) -> bool:
    word = token >> 5
    return word < row.shape[0] and bool((int(row[word]) >> (token & 31)) & 1)


def _restricted_q(
    q_all: torch.Tensor,  # [N_old, V]
    q_rows: list[int],
    tokens: list[int],
    parents: list[int],
    bitmask: torch.Tensor,  # [N_new, W]
) -> torch.Tensor:
    """q rows for the new tree: a kept node's q restricted to what its parent's grammar state
    allows and renormalised (q'); a forced node's q one-hot at its token; the root's zeros."""
    width = q_all.shape[-1]
    out = torch.zeros(len(tokens), width, dtype=q_all.dtype, device=q_all.device)  # [N, V]
    allowed = bitmask_to_bool(bitmask, width).to(q_all.device)  # [N, V]
    for i in range(1, len(tokens)):
        src = q_rows[i]
        if src < 0:
            out[i, tokens[i]] = 1.0
            continue
        q = q_all[src].masked_fill(~allowed[parents[i]], 0.0)
        total = float(q.sum())
        out[i] = q / total if total > 0.0 else q_all[src]
    return out
