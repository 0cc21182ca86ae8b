"""EAGLE drafting with EAGLE-2's dynamic token trees.

Each step the drafter first absorbs what the last verification pass produced: the target's
features at the newly committed positions, paired with the tokens that followed them. Those
pairs extend the drafter's own KV cache exactly as if it had read the target's features all
along (draft-predicted features never stay in the cache). Then it grows a tree from the root:

* depth 1: the top-k children of the root by the drafter's log-probability;
* each further depth: the k most promising nodes so far, ranked by *cumulative* log-probability
  (EAGLE-2's observation: the drafter's confidence tracks the acceptance rate), are expanded
  together in one drafter pass under a tree mask, each contributing its top-k children;
* finally the best nodes by cumulative score are kept (ancestors always included).

How many nodes to keep is priced rather than fixed: expected tokens per step ≈ 1 + Σ p(node)
over the kept nodes (p = exp(cumulative log-probability), the chance its whole path is
accepted), and verifying n nodes costs T(n + 1) / T(1) decode steps as the engine's cost model
measures them on this hardware (``context.costs``),
so the tree keeps the n that maximises their ratio, up to ``total_tokens``; none when no tree
pays. The choice depends only on the drafter's scores, never on timing, so sampled output
stays reproducible.

Trees are deterministic (q = one-hot, siblings distinct), so both lossless rules apply: the
greedy walk and multi-draft rejection sampling.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.errors import ConfigError
from specdec.heads.eagle import EagleHead, extend_kv, for_inference
from specdec.speculators.base import DraftContext, Speculator
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.target import LoadedModel
from specdec.tree import DraftTree


@dataclass(frozen=True)
class EagleTree:
    """EAGLE-2's knobs: expansion depth, children per expanded node (also the number of nodes
    expanded per depth), and the most nodes verified."""

    depth: int = 5
    top_k: int = 4
    total_tokens: int = 24

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ConfigError(
                f"EAGLE tree needs depth, top-k and total tokens >= 1, got {self.depth}, "
                f"{self.top_k}, {self.total_tokens}"
            )

    @classmethod
    def parse(cls, spec: str | None, depth: int | None = None) -> EagleTree:
        """``"DEPTH,TOPK,TOTAL"`` (any suffix may be left out; ``x`` separates too, as in the
        bench's ``eagle:DIR@5x4x24`` where commas separate methods); ``None`` = the defaults
        with the checkpoint's own ``depth``.

        >>> EagleTree.parse("6x8x60")
        EagleTree(depth=6, top_k=8, total_tokens=60)
        >>> EagleTree.parse(None, depth=3).depth
        3
        """
        if spec is None or spec == "":
            return cls() if depth is None else cls(depth=depth)
        text = spec.replace(" ", "").replace("x", ",")
        if not re.fullmatch(r"\d+(,\d+){0,2}", text):
            raise ConfigError(
                f"eagle tree must be DEPTH[xTOPK[xTOTAL]] (e.g. 5x4x24), got {spec!r}"
            )
        values = [int(v) for v in text.split(",")]
        return cls(*values)  # type: ignore[arg-type]


@dataclass
class _Node:
    token: int  # target id
    parent: int  # index into the node list, -1 = the root
    score: float  # cumulative log-probability of the path from the root
    depth: int
    state: torch.Tensor  # [H] the drafter state that predicted this token (its input state)


@dataclass(frozen=True, kw_only=True)
class EagleOptions(SpeculatorOptions):
    primary = "dir"
    dir: str | None = option(
        None,
        help="drafter directory (`specdec train eagle`, speculators or EAGLE authors' layout; "
        "default: the EAGLE-3 head shipped for the bundled SmolLM2-135M-Instruct)",
    )
    tree: str | None = option(
        None,
        help="DEPTHxTOPKxTOTAL of EAGLE-2's dynamic tree (default: 5x4x24, the "
        "checkpoint's depth); the kept node count is sized per step against verification cost",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        EagleTree.parse(self.tree)  # a bad tree fails here, before the drafter loads


class EagleSpeculator(Speculator):
    name: ClassVar[str] = "eagle"
    needs_hidden_states: ClassVar[bool] = True
    drafts_trees: ClassVar[bool] = True
    drafts_by_model: ClassVar[bool] = True
    watches: ClassVar[bool] = True
    # watch() only extends the drafter's cache, and absorb() takes many steps' rows in one
    # pass: ``auto`` may defer it until this speculator drafts
    watch_batches: ClassVar[bool] = True

    def __init__(self, head: EagleHead, tree: EagleTree | None = None) -> None:
        self.head = for_inference(head)
        self.tree = tree or EagleTree(depth=head.config.speculative_tokens)
        self.feature_layers: tuple[int, ...] = head.config.aux_layers
        self._past: tuple[torch.Tensor, torch.Tensor] | None = None  # [1, KV, S, D] each
        self._root_state: tuple[int, torch.Tensor] | None = None  # (root position, state)

    def reset(self) -> None:
        self._past = None
        self._root_state = None

    @property
    def cached(self) -> int:
        return 0 if self._past is None else int(self._past[0].shape[2])

    @torch.inference_mode()
    def absorb(self, context: DraftContext) -> torch.Tensor | None:
        """Extend the drafter's cache with the newly committed (feature, next token) pairs;
        returns the drafter state at the last one, which predicts the root's children.  # [H]

        The pair at position p is (target feature at p, token p + 1). A gap (features the
        drafter never saw, e.g. steps another speculator drafted) leaves positions missing from
        its cache: drafts get worse there, never wrong, since the target verifies them."""
        tokens, features = context.tokens, context.features
        root_pos = len(tokens) - 1
        if features is None or len(features) == 0 or root_pos < 1:
            return None
        if self._root_state is not None and self._root_state[0] == root_pos:
            if self.cached == root_pos:  # already absorbed this step (watch, then propose)
                return self._root_state[1]
        n = min(len(features), root_pos)
        first = root_pos - n
        if self.cached > first:  # positions already absorbed (a re-proposal): drop them
            assert self._past is not None
            self._past = (self._past[0][:, :, :first], self._past[1][:, :, :first])
        state = self.head.fuse(features[-n:].to(torch.float32))[None]  # [1, n, H]
        device = state.device
        ids = torch.tensor([tokens[first + 1 : root_pos + 1]], dtype=torch.long, device=device)
        positions = torch.arange(first, root_pos, device=device)[None]  # [1, n]
        out, (k, v) = self.head(state, ids, positions, self._past)
        self._past = extend_kv(self._past, (k, v))
        self._root_state = (root_pos, out[0, -1])
        return out[0, -1]

    def watch(self, context: DraftContext) -> None:
        """Absorb a step's features without drafting: the ``auto`` controller calls it every
        step, so steps another speculator drafted leave no gap in the drafter's cache."""
        self.absorb(context)

    @torch.inference_mode()
    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        root = context.tokens[-1]
        h_root = self.absorb(context)
        if h_root is None or budget < 1:
            return DraftTree.root_only(root)
        cap = min(budget, self.tree.total_tokens)
        # the average price of a node in a full tree: deeper nodes less likely than this stop;
        # with a fixed length (adaptive=False) the whole tree is drafted, priced or not, so a
        # chain drafts exactly its depth, as vLLM's EAGLE does
        fixed = context.fixed_length
        slope = 0.0 if fixed else (context.tree_cost(cap + 1) - 1.0) / cap
        nodes = self._expand(h_root, root_pos=len(context.tokens) - 1, slope=slope)
        keep = self._select(nodes, cap, context, fixed=fixed)
        return _to_tree(root, nodes, keep)

    def _children(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (log-probability, target id) after each state.  # [M, k] each"""
        logp = torch.log_softmax(self.head.logits(states).float(), dim=-1)
        values, ids = logp.topk(min(self.tree.top_k, logp.shape[-1]), dim=-1)
        return values, self.head.to_target_ids(ids)

    def _expand(self, h_root: torch.Tensor, root_pos: int, slope: float) -> list[_Node]:
        k = self.tree.top_k
        values, ids = self._children(h_root[None])
        nodes = [
            _Node(int(t), -1, float(v), 1, h_root)
            for v, t in zip(values[0].tolist(), ids[0].tolist(), strict=True)
        ]
        frontier = list(range(len(nodes)))
        assert self._past is not None
        past = self._past
        cached = self.cached
        slot: dict[int, int] = {}  # node -> index of its KV entry among the tree's entries
        for depth in range(2, self.tree.depth + 1):
            states = torch.stack([nodes[i].state for i in frontier])[None]  # [1, F, H]
            device = states.device
            ids_in = torch.tensor([[nodes[i].token for i in frontier]], device=device)
            positions = torch.full((1, len(frontier)), root_pos + depth - 2, device=device)
            mask = self._tree_mask(nodes, frontier, slot, cached).to(device)
            out, (k_new, v_new) = self.head(states, ids_in, positions, past, mask)
            for i in frontier:
                slot[i] = len(slot)
            past = extend_kv(past, (k_new, v_new))
            values, ids = self._children(out[0])  # [F, k]
            start = len(nodes)
            for j, i in enumerate(frontier):
                base = nodes[i].score
                for v, t in zip(values[j].tolist(), ids[j].tolist(), strict=True):
                    nodes.append(_Node(int(t), i, base + v, depth, out[0, j]))
            candidates = range(start, len(nodes))
            frontier = sorted(candidates, key=lambda c: nodes[c].score, reverse=True)[:k]
            if math.exp(nodes[frontier[0]].score) < slope:
                break  # no deeper node can pay for its verification: stop drafting
        return nodes

    @staticmethod
    def _tree_mask(
        nodes: list[_Node], frontier: list[int], slot: dict[int, int], cached: int
    ) -> torch.Tensor:
        """Each frontier node sees the committed cache, its expanded ancestors, itself."""
        width = cached + len(slot) + len(frontier)
        mask = torch.zeros(len(frontier), width, dtype=torch.bool)
        mask[:, :cached] = True
        for row, i in enumerate(frontier):
            mask[row, cached + len(slot) + row] = True
            a = nodes[i].parent
            while a >= 0:
                mask[row, cached + slot[a]] = True
                a = nodes[a].parent
        return mask[None]

    def _select(
        self, nodes: list[_Node], cap: int, context: DraftContext, *, fixed: bool = False
    ) -> list[int]:
        """The ancestor-closed set of at most ``cap`` nodes that maximises expected tokens per
        unit of verification cost (empty when drafting does not pay); ``fixed``: the ``cap``
        most likely nodes, whatever they cost."""
        order = sorted(range(len(nodes)), key=lambda i: nodes[i].score, reverse=True)
        chosen: list[int] = []
        seen: set[int] = set()
        gain, best_rate, best_n = 0.0, 1.0, 0
        for i in order:
            path = []
            a = i
            while a >= 0 and a not in seen:
                path.append(a)
                a = nodes[a].parent
            if len(chosen) + len(path) > cap:
                break
            for a in reversed(path):
                seen.add(a)
                chosen.append(a)
                gain += math.exp(nodes[a].score)
            rate = (1.0 + gain) / context.tree_cost(1 + len(chosen))
            if rate > best_rate:
                best_rate, best_n = rate, len(chosen)
        return chosen if fixed else chosen[:best_n]


def _to_tree(root: int, nodes: list[_Node], keep: list[int]) -> DraftTree:
    """Parents before children: ``keep`` is ancestor-closed and lists ancestors first."""
    index = {node: j + 1 for j, node in enumerate(keep)}
    tokens = [root] + [nodes[i].token for i in keep]
    parents = [-1] + [0 if nodes[i].parent < 0 else index[nodes[i].parent] for i in keep]
    return DraftTree(tokens=tuple(tokens), parents=tuple(parents))


@register("eagle", EagleOptions)
def _build(target: LoadedModel, options: EagleOptions) -> EagleSpeculator:
    """EAGLE-1/3 drafter over the target's features, EAGLE-2 dynamic trees"""
    from specdec.heads.bundled import eagle_head

    head = eagle_head(options.dir, target)
    tree = EagleTree.parse(options.tree, head.config.speculative_tokens)
    return EagleSpeculator(head, tree)
