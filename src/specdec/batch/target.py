"""The target seen by a batch: one forward pass verifies every sequence's draft tree.

Each sequence brings its own tree (chains and trees of any size), its own positions (its
committed length plus the node's depth), and its own mask over its own cache row: its committed
slots and, among the pass's new slots, its tree ancestors (see :mod:`specdec.batch.cache` for
the layout). Sliding-window layers get the same mask cut to the window on each query's and
key's own positions, as in :mod:`specdec.target.masks`.

**Packed (ragged) passes.** The projections, MLPs and LM head, which are nearly all of a pass's
arithmetic, run over the trees' nodes packed into one sequence of ``sum(len(tree))`` tokens, not
over ``rows x widest tree``: one sequence drafting four tokens adds four rows to the pass, not
four per sequence. Only attention, which reads each row's own cache, sees the padded
``[rows, widest, ...]`` layout: :func:`packed_attention` scatters the packed queries into it and
gathers the outputs back, and the cache writes each packed key at its row's next slots. So the
cost of a pass is T(total nodes) and the batch budget can let one confident sequence draft while the
others do not. This is transformers' public attention interface
(``AttentionInterface.register``), switched on for the pass only; a model whose attention is not
one registered there (eager) gets the padded pass, where a padding query sees only its row's
first new slot, so no softmax row is empty, and its logits are dropped.

**Prompts ride the passes.** A newcomer gets a row at once (:meth:`BatchTarget.attach`) and its
prompt enters as the *prefix* of its row in the next verification passes, a chunk per pass
(:meth:`BatchTarget.verify`'s ``prefixes``): a causal chain from the row's committed end,
followed, in the pass that completes the prompt, by the row's first tree. On a CPU every pass
streams all the weights, so a chunk in the others' pass costs its rows, not a pass of its own
(much less than two passes: ``docs/batching.md``), and the chunk's logits are never
computed (only the trees' nodes reach the LM head). A newcomer therefore delays the others by
one chunk's rows per step, never by its whole prompt. The older way, one chunk per call on a
private single-sequence cache (:meth:`prefill_chunk`, :meth:`prefill_packed`) copied into a row
when complete, remains for padded targets, where a chunk would widen every row of the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec.batch.cache import SlotCache
from specdec.cache.layout import FULL, SLIDING
from specdec.target import LoadedModel, ModelRunner
from specdec.tree import DraftTree

DEFAULT_CHUNK = 64  # prompt tokens per prefill call
PACKED_ATTENTION = "specdec_packed"
GROUP_SLACK = 8  # padding queries a row may carry beyond its own nodes in a shared call


@dataclass(frozen=True)
class _Group:
    """Rows whose non-root nodes share one padded attention call."""

    rows: torch.Tensor  # [g] the rows (within the pass)
    width: int  # non-root nodes of its widest row
    nodes: torch.Tensor  # [M] packed index of each of its rows' non-root nodes
    at_row: torch.Tensor  # [M] that node's row's index within the group
    at_col: torch.Tensor  # [M] its place among its row's non-root nodes
    span: int  # the slots its rows' nodes reach: the keys its call reads


def _group_rows(sizes: Sequence[int]) -> list[list[int]]:
    """Rows with more than a root, widest first, grouped so that no row is padded by more
    than its own nodes plus ``GROUP_SLACK`` queries: a 64-token prefill chunk gets its own call
    instead of padding every drafted row to 64 queries, while drafts of a few nodes share one
    (each call has a fixed cost per layer).

    >>> _group_rows([1, 3, 65, 2, 3, 1, 40])
    [[2, 6], [1, 4, 3]]
    """
    wide = sorted((r for r, k in enumerate(sizes) if k > 1), key=lambda r: -sizes[r])
    groups: list[list[int]] = []
    for r in wide:
        extra = sizes[r] - 1
        if groups and sizes[groups[-1][0]] - 1 <= 2 * extra + GROUP_SLACK:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


@dataclass(frozen=True)
class Packing:
    """Where each token of a packed pass sits in the padded ``[rows, width]`` layout.

    Attention runs in parts: every row's root (one query per row, the cheap case), then the
    other nodes of the rows that have more, in groups of similar size (:func:`_group_rows`),
    each over its rows' caches only. One padded call would make every row attend ``width``
    queries over its whole cache, which on a CPU costs about as much as the projections of the
    extra nodes themselves; with a prefill chunk in the pass, many times more."""

    rows: torch.Tensor  # [N] row (within the pass) of each packed token
    cols: torch.Tensor  # [N] its node index in that row's tree
    n: int
    width: int
    base: Callable[..., tuple[torch.Tensor, Any]]  # the model's own attention function
    roots: torch.Tensor  # [n] packed index of each row's root
    groups: tuple[_Group, ...]
    slots: torch.Tensor  # [N] the cache slot each token is written to: its row's next ones

    @classmethod
    def of(
        cls,
        sizes: Sequence[int],
        base: Callable[..., tuple[torch.Tensor, Any]],
        device: Any,
        lengths: torch.Tensor,  # [n] committed entries per row
    ) -> Packing:
        rows = torch.cat([torch.full((k,), r, dtype=torch.long) for r, k in enumerate(sizes)])
        cols = torch.cat([torch.arange(k) for k in sizes])
        starts = [0]
        for k in sizes[:-1]:
            starts.append(starts[-1] + k)
        groups = []
        for members in _group_rows(sizes):
            reach = max(int(lengths[r]) + sizes[r] for r in members)
            nodes = [starts[r] + c for r in members for c in range(1, sizes[r])]
            at_row = [i for i, r in enumerate(members) for _ in range(1, sizes[r])]
            at_col = [c - 1 for r in members for c in range(1, sizes[r])]
            groups.append(
                _Group(
                    torch.tensor(members, dtype=torch.long, device=device),
                    sizes[members[0]] - 1,
                    torch.tensor(nodes, dtype=torch.long, device=device),
                    torch.tensor(at_row, dtype=torch.long, device=device),
                    torch.tensor(at_col, dtype=torch.long, device=device),
                    reach,
                )
            )
        return cls(
            rows.to(device),
            cols.to(device),
            len(sizes),
            max(sizes),
            base,
            torch.tensor(starts, dtype=torch.long, device=device),
            tuple(groups),
            (lengths[rows] + cols).to(device),
        )


_PACKING: ContextVar[Packing | None] = ContextVar("specdec_packing", default=None)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, N, head_dim]: the pass's nodes, packed
    key: torch.Tensor,  # [rows, kv_heads, slots, head_dim]: each row's own cache
    value: torch.Tensor,
    attention_mask: torch.Tensor,  # [rows, 1, width, slots]
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The model's own attention function over each row's cache, for packed queries (see
    :class:`Packing`): the roots in one call, each group's other nodes in one more."""
    p = _PACKING.get()
    if p is None:
        raise RuntimeError(f"the {PACKED_ATTENTION!r} attention runs only inside a packed pass")
    flat = query[0].transpose(0, 1)  # [N, heads, head_dim]
    out = torch.empty_like(flat)
    roots = flat[p.roots][:, :, None]  # [n, heads, 1, head_dim]
    first, _ = p.base(module, roots, key, value, attention_mask[:, :, :1], **kwargs)
    out[p.roots] = first[:, 0]  # [n, 1, heads, head_dim] -> [n, heads, head_dim]
    for g in p.groups:
        padded = query.new_zeros(len(g.rows), flat.shape[1], g.width, flat.shape[2])
        padded[g.at_row, :, g.at_col] = flat[g.nodes]
        keys = key.index_select(0, g.rows)[:, :, : g.span]
        values = value.index_select(0, g.rows)[:, :, : g.span]
        mask = attention_mask.index_select(0, g.rows)[:, :, 1 : 1 + g.width, : g.span]
        others, _ = p.base(module, padded, keys, values, mask, **kwargs)  # [g, w, h, hd]
        out[g.nodes] = others[g.at_row, g.at_col]
    return out[None], None  # [1, N, heads, head_dim]


def _register_packed() -> None:
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


@contextmanager
def _packed(model: torch.nn.Module, packing: Packing) -> Iterator[None]:
    """Route ``model``'s attention through :func:`packed_attention` for one pass."""
    config = cast(PretrainedConfig, model.config)  # a transformers model's config
    previous = config._attn_implementation
    token = _PACKING.set(packing)
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
        _PACKING.reset(token)


def _base_attention(model: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]] | None:
    """The registered attention function the model uses, or ``None`` (eager, or unknown): then
    passes are padded."""
    name = getattr(model.config, "_attn_implementation", None)
    if not isinstance(name, str) or name == PACKED_ATTENTION:
        return None
    try:
        return ALL_ATTENTION_FUNCTIONS[name]
    except KeyError:
        return None


@dataclass
class Prefill:
    """A sequence's prompt on its way into the batch."""

    tokens: list[int]  # prompt[:-1]: what the cache must hold (the last is the first root)
    runner: ModelRunner
    done: int = 0
    features: list[torch.Tensor] = field(default_factory=list)  # [chunk, H] per chunk

    @property
    def finished(self) -> bool:
        return self.done >= len(self.tokens)


def _entries(
    buffer: torch.Tensor | None, cut: slice | None = None
) -> torch.Tensor | None:  # [heads, L, dim]
    """A prefill cache layer's entries (``[1, heads, L, dim]``) as one row's, or ``None``."""
    if buffer is None or buffer.numel() == 0:
        return None
    return buffer[0] if cut is None else buffer[0, :, cut]


class BatchTarget:
    """The target model over a :class:`SlotCache`: prefill, verify a batch, commit per row.

    Rows are addressed by index into the cache (the prefix of rows in use); the scheduler
    keeps the mapping from its sequences to rows and applies :meth:`remove`'s move."""

    def __init__(
        self, loaded: LoadedModel, *, chunk: int = DEFAULT_CHUNK, packed: bool = True
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.runner = ModelRunner(loaded.model)  # for its settings: device, dtype, hidden layers
        self.cache = SlotCache(loaded.model.config)
        self.chunk = chunk
        self.output_hidden = False
        self.hidden_layers: tuple[int, ...] = (-1,)
        self.features: list[torch.Tensor | None] = []  # per row, as HFTarget.features
        self._base_slots: list[int] = []  # where each row's nodes began in the last pass
        self._hidden: list[torch.Tensor] | None = None
        self._prefix: list[int] = []  # prefix tokens per row in the last pass
        self._base = _base_attention(loaded.model) if packed else None
        if self._base is not None:
            _register_packed()
        self.last_rows = 0  # token rows the last pass computed (packed: its nodes)

    @property
    def packed(self) -> bool:
        """Whether passes are packed (their cost is T(total nodes), not T(rows x widest))."""
        return self._base is not None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    def enable_features(self, layers: Sequence[int] = (-1,)) -> None:
        self.output_hidden = True
        self.hidden_layers = tuple(int(i) for i in layers)

    def __len__(self) -> int:
        return len(self.cache)

    # -- prefill --------------------------------------------------------------------------------
    def start_prefill(self, prompt: Sequence[int]) -> Prefill:
        runner = ModelRunner(self.model)
        runner.output_hidden = self.output_hidden
        runner.hidden_layers = self.hidden_layers
        return Prefill(list(prompt[:-1]), runner)

    @torch.inference_mode()
    def prefill_chunk(self, prefill: Prefill, chunk: int | None = None) -> int | None:
        """Feed ``prefill``'s next chunk on its own cache; when the prompt is in, move it into
        a new row and return the row's index (else ``None``)."""
        if not prefill.finished:
            size = chunk or self.chunk
            part = prefill.tokens[prefill.done : prefill.done + size]
            prefill.runner.forward(part, logits_to_keep=1)
            prefill.done += len(part)
            if prefill.runner.last_hidden is not None:
                prefill.features.append(prefill.runner.last_hidden)
        if not prefill.finished:
            return None
        return self.attach(prefill)  # its cache now lives in the row

    @torch.inference_mode()
    def prefill_packed(self, prefills: Sequence[Prefill]) -> list[int]:
        """Prefill several fresh prompts in ONE forward pass, packed one after another with
        positions restarting at 0 for each and a block-diagonal causal mask, so each sees only
        itself (what its own prefill computes); the entries are then split into new rows.

        One pass instead of one per newcomer matters on a CPU, where every pass streams all the
        weights: admitting several requests in a step costs about one pass, not several."""
        if len(prefills) == 1 or any(p.done for p in prefills):
            rows = []
            for p in prefills:
                row = self.prefill_chunk(p, len(p.tokens) - p.done or 1)
                assert row is not None
                rows.append(row)
            return rows
        sizes = [len(p.tokens) for p in prefills]
        tokens = [t for p in prefills for t in p.tokens]
        if not tokens:  # one-token prompts: nothing to cache
            return [self._add(p, [None] * len(self.cache.hf.layers), []) for p in prefills]
        total = len(tokens)
        positions = torch.cat([torch.arange(n) for n in sizes])  # [T]
        mask = torch.zeros(total, total, dtype=torch.bool)  # [T, T] block-diagonal causal
        offset = 0
        for n in sizes:
            mask[offset : offset + n, offset : offset + n] = torch.ones(n, n).tril().bool()
            offset += n
        runner = prefills[0].runner
        runner.forward(tokens, position_ids=positions, tree_mask=mask, logits_to_keep=1)
        hidden = runner.last_hidden
        layers = runner.cache.hf.layers
        all_keys = [getattr(layer, "keys", None) for layer in layers]
        all_values = [getattr(layer, "values", None) for layer in layers]
        rows, offset = [], 0
        for p, n in zip(prefills, sizes, strict=True):
            cut = slice(offset, offset + n)
            keys = [_entries(k, cut) for k in all_keys]
            values = [_entries(v, cut) for v in all_values]
            p.done = n
            if hidden is not None and n:
                p.features.append(hidden[cut])
            rows.append(self._add(p, keys, values))
            offset += n
        runner.reset()
        return rows

    @torch.inference_mode()
    def attach(self, prefill: Prefill) -> int:
        """A row for a prompt whose remaining tokens will ride verification passes as
        prefixes (:meth:`verify`); it holds what ``prefill`` cached so far (nothing, for a
        fresh one). Returns the row's index."""
        layers = prefill.runner.cache.hf.layers
        keys = [_entries(getattr(layer, "keys", None)) for layer in layers]
        values = [_entries(getattr(layer, "values", None)) for layer in layers]
        prefill.runner.reset()
        return self._add(prefill, keys, values)

    def _add(
        self,
        prefill: Prefill,
        keys: Sequence[torch.Tensor | None],
        values: Sequence[torch.Tensor | None],
    ) -> int:
        row = self.cache.add_row(keys, values or [None] * len(keys))
        self.features.append(torch.cat(prefill.features) if prefill.features else None)
        return row

    @torch.inference_mode()
    def remove(self, row: int) -> None:
        """Free ``row``: the last row moves into it. The last row out frees the buffers, so a
        burst of long sequences does not hold its memory while the batch is empty."""
        self.cache.remove_row(row)
        last = self.features.pop()
        if row < len(self.features):
            self.features[row] = last
        if not len(self.cache):
            self.cache = SlotCache(self.model.config)

    # -- verification ---------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(
        self,
        trees: Sequence[DraftTree | None],
        prefixes: Sequence[Sequence[int]] | None = None,
    ) -> list[torch.Tensor | None]:
        """Score every row's tree in one pass (``trees[r]`` for row ``r``; every row in use
        takes part).  Returns each row's logits ``[len(trees[r]), V]``.

        ``prefixes[r]``, when given, are prompt tokens row ``r`` prefills in this pass, ahead
        of its tree: a causal chain from the row's committed length, whose root's parent is the
        chain's last token (the tree of a row that finishes its prompt here), or alone
        (``trees[r]`` ``None``, a prompt still under way: no logits, ``None`` returned). So a
        newcomer's prefill chunk rides the others' verification pass, which on a CPU costs its
        extra rows and not one more pass over the weights."""
        n = len(trees)
        if n != len(self.cache):
            raise ValueError(f"{n} trees for {len(self.cache)} rows: every row takes part")
        pre = [len(p) for p in prefixes] if prefixes is not None else [0] * n
        if len(pre) != n:
            raise ValueError(f"{len(pre)} prefixes for {n} rows")
        lengths = torch.tensor(self.cache.lengths, dtype=torch.long)  # [n]
        kept = [0 if t is None else len(t) for t in trees]  # nodes whose logits are returned
        sizes = [p + k for p, k in zip(pre, kept, strict=True)]
        if not all(sizes):
            raise ValueError("every row needs a tree or prefix tokens")
        width = max(sizes)
        at = int(lengths.max())
        packing: Packing | None = None
        if self._base is not None and sum(sizes) < n * width:
            packing = Packing.of(sizes, self._base, self.device, lengths)
        ids = torch.empty(n, width, dtype=torch.long)
        depth = torch.empty(n, width, dtype=torch.long)
        # [n, T, T] query x new slot; a padding query sees its row's first new slot only
        new = torch.zeros(n, width, width, dtype=torch.bool)
        new[:, :, 0] = True
        pad = torch.arange(width)
        for r, tree in enumerate(trees):
            size, p = sizes[r], pre[r]
            tokens = list(prefixes[r]) if p and prefixes is not None else []
            depths = list(range(p))
            if tree is not None:
                tokens.extend(tree.tokens)
                depths.extend(p + d for d in tree.depths)
            ids[r] = tokens[0]
            ids[r, :size] = torch.tensor(tokens)
            depth[r] = pad
            depth[r, :size] = torch.tensor(depths)
            new[r, :size, 0] = False
            if p:
                new[r, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
                new[r, p:size, :p] = True
            if tree is not None:
                new[r, p:size, p:size] = tree.ancestor_mask()
        positions = lengths[:, None] + depth  # [n, T]
        # where each row's new slots start: its own end (packed), or the common offset; the
        # pass attends over the slots its rows' nodes reach (padding columns cut off)
        if packing is not None:
            base = lengths
            span = int((lengths + torch.tensor(sizes)).max())
        else:
            base = torch.full((n,), at, dtype=torch.long)
            span = at + width
        col = torch.arange(span)
        full = torch.zeros(n, width, span, dtype=torch.bool)  # [n, T, S]
        key_pos = col[None, :].repeat(n, 1)  # committed slot j is position j
        for r in range(n):
            b = int(base[r])
            w = min(width, span - b)
            full[r, :, : int(lengths[r])] = True
            full[r, :, b : b + w] = new[r, :, :w]
            key_pos[r, b : b + w] = positions[r, :w]
        layout = self.cache.layout
        masks: dict[str, torch.Tensor] = {}
        if FULL in layout.mask_types:
            masks[FULL] = full[:, None]
        if SLIDING in layout.mask_types:
            window = layout.window
            assert window is not None
            near = (positions[:, :, None] - key_pos[:, None, :]) < window  # [n, T, S]
            masks[SLIDING] = (full & near)[:, None]
        device = self.device
        masks = {k: m.to(device) for k, m in masks.items()}
        mask = masks if layout.mixed else next(iter(masks.values()))
        keep: torch.Tensor | int = 0  # logits for every node
        if packing is not None:
            rows, cols = packing.rows.cpu(), packing.cols.cpu()
            ids, positions = ids[rows, cols][None], positions[rows, cols][None]  # [1, N]
            if any(pre):  # the prefix tokens' logits are never read: skip their LM head
                starts = packing.roots.cpu()
                keep = torch.cat([starts[r] + pre[r] + torch.arange(kept[r]) for r in range(n)]).to(
                    device
                )
        self.cache.begin_pass(0, n, at, span, packing)
        kwargs: dict[str, Any] = {self.runner.cache_keyword: self.cache.hf}
        if isinstance(keep, torch.Tensor):
            kwargs["logits_to_keep"] = keep
        try:
            with _packed(self.model, packing) if packing is not None else nullcontext():
                out = self.model(
                    input_ids=ids.to(device),
                    position_ids=positions.to(device),
                    attention_mask=mask,
                    use_cache=True,
                    output_hidden_states=self.output_hidden,
                    **kwargs,
                )
        finally:
            self.cache.end_pass()
        self._base_slots = [int(b) for b in base]
        self._prefix = pre
        self.last_rows = sum(sizes) if packing is not None else n * width
        self._hidden = None
        logits: list[torch.Tensor | None]
        if packing is not None and isinstance(keep, torch.Tensor):
            logits = list(torch.split(out.logits[0], kept))
        elif packing is not None:
            logits = list(torch.split(out.logits[0], sizes))
        else:
            logits = [out.logits[r, pre[r] : sizes[r]] for r in range(n)]
        logits = [None if t is None else x for t, x in zip(trees, logits, strict=True)]
        if self.output_hidden:
            states = out.hidden_states
            hidden = torch.cat([states[i] for i in self.hidden_layers], -1)  # [n or 1, T, H]
            if packing is not None:
                self._hidden = list(torch.split(hidden[0], sizes))
            else:
                self._hidden = [hidden[r, :k] for r, k in enumerate(sizes)]
        return logits

    @torch.inference_mode()
    def commit(self, paths: Sequence[Sequence[int] | None]) -> None:
        """Row ``r`` keeps the nodes ``paths[r]`` of its last verified tree, after the prefix
        tokens it prefilled in that pass (all of them; ``None``: a row that had no tree)."""
        full: list[list[int]] = []
        for r, path in enumerate(paths):
            p = self._prefix[r] if r < len(self._prefix) else 0
            if path is None and not p:
                raise ValueError(f"row {r} verified a tree: give its path")
            full.append(list(range(p)) + [p + i for i in (path or ())])
        self.cache.commit(
            [[b + i for i in path] for b, path in zip(self._base_slots, full, strict=True)]
        )
        if self._hidden is not None:
            for r, path in enumerate(full):
                mine = self._hidden[r][path]
                before = self.features[r]
                if self._prefix[r] and before is not None:  # a prompt's features accumulate
                    mine = torch.cat([before, mine])
                self.features[r] = mine
