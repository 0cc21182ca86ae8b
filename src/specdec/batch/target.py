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
gathers the outputs back, and the cache writes each packed key at its row's slot. So the cost of
a pass is T(total nodes) and the batch budget can let one confident sequence draft while the
others do not. This is transformers' public attention interface
(``AttentionInterface.register``), switched on for the pass only; a model whose attention is not
one registered there (eager) gets the padded pass, where a padding query sees only its own
slot, so no softmax row is empty, and its logits are dropped.

Prefill runs beside the batch, one chunk per call, on a private single-sequence cache
(:class:`~specdec.target.ModelRunner`); a finished prefill is copied into a new row once. A
newcomer therefore delays the others by at most one chunk per step, never by its whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec.batch.cache import SlotCache
from specdec.cache.layout import FULL, SLIDING
from specdec.target import LoadedModel, ModelRunner
from specdec.tree import DraftTree

DEFAULT_CHUNK = 64  # prompt tokens per prefill call
PACKED_ATTENTION = "specdec_packed"


@dataclass(frozen=True)
class Packing:
    """Where each token of a packed pass sits in the padded ``[rows, width]`` layout.

    Attention runs in two parts: every row's root (one query per row, the cheap case) and the
    other nodes of the rows that drafted, over those rows' caches only. One padded call would
    make every row attend ``width`` queries over its whole cache, which on a CPU costs about as
    much as the projections of the extra nodes themselves."""

    rows: torch.Tensor  # [N] row (within the pass) of each packed token
    cols: torch.Tensor  # [N] its node index in that row's tree
    n: int
    width: int
    base: Callable[..., tuple[torch.Tensor, Any]]  # the model's own attention function
    roots: torch.Tensor  # [n] packed index of each row's root
    drafted: torch.Tensor  # [d] the rows with more than a root
    rest: torch.Tensor  # [M] packed index of every other node
    rest_rows: torch.Tensor  # [M] its row's index among ``drafted``

    @classmethod
    def of(
        cls, sizes: Sequence[int], base: Callable[..., tuple[torch.Tensor, Any]], device: Any
    ) -> Packing:
        rows = torch.cat([torch.full((k,), r, dtype=torch.long) for r, k in enumerate(sizes)])
        cols = torch.cat([torch.arange(k) for k in sizes])
        starts = torch.tensor([0, *sizes[:-1]], dtype=torch.long).cumsum(0)
        drafted = [r for r, k in enumerate(sizes) if k > 1]
        among = torch.full((len(sizes),), -1, dtype=torch.long)
        among[drafted] = torch.arange(len(drafted))
        rest = (cols > 0).nonzero().squeeze(1)
        return cls(
            rows.to(device),
            cols.to(device),
            len(sizes),
            max(sizes),
            base,
            starts.to(device),
            torch.tensor(drafted, dtype=torch.long, device=device),
            rest.to(device),
            among[rows[rest]].to(device),
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
    :class:`Packing`): the roots in one call, the drafted rows' other nodes in another."""
    p = _PACKING.get()
    if p is None:
        raise RuntimeError(f"the {PACKED_ATTENTION!r} attention runs only inside a packed pass")
    flat = query[0].transpose(0, 1)  # [N, heads, head_dim]
    out = torch.empty_like(flat)
    roots = flat[p.roots][:, :, None]  # [n, heads, 1, head_dim]
    first, _ = p.base(module, roots, key, value, attention_mask[:, :, :1], **kwargs)
    out[p.roots] = first[:, 0]  # [n, 1, heads, head_dim] -> [n, heads, head_dim]
    if p.rest.numel():
        d = p.drafted.numel()
        padded = query.new_zeros(d, flat.shape[1], p.width - 1, flat.shape[2])
        padded[p.rest_rows, :, p.cols[p.rest] - 1] = flat[p.rest]
        keys, values = key.index_select(0, p.drafted), value.index_select(0, p.drafted)
        mask = attention_mask.index_select(0, p.drafted)[:, :, 1:]
        others, _ = p.base(module, padded, keys, values, mask, **kwargs)  # [d, w-1, h, hd]
        out[p.rest] = others[p.rest_rows, p.cols[p.rest] - 1]
    return out[None], None  # [1, N, heads, head_dim]


def _register_packed() -> None:
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


@contextmanager
def _packed(model: torch.nn.Module, packing: Packing) -> Iterator[None]:
    """Route ``model``'s attention through :func:`packed_attention` for one pass."""
    config = model.config
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
        self._write_at = 0
        self._hidden: list[torch.Tensor] | None = None
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
        layers = prefill.runner.cache.hf.layers
        keys = [_entries(getattr(layer, "keys", None)) for layer in layers]
        values = [_entries(getattr(layer, "values", None)) for layer in layers]
        prefill.runner.reset()  # its cache now lives in the row
        return self._add(prefill, keys, values)

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
    def verify(self, trees: Sequence[DraftTree]) -> list[torch.Tensor]:
        """Score every row's tree in one pass (``trees[r]`` for row ``r``; every row in use
        takes part).  Returns each row's logits ``[len(trees[r]), V]``."""
        n = len(trees)
        if n != len(self.cache):
            raise ValueError(f"{n} trees for {len(self.cache)} rows: every row takes part")
        lengths = torch.tensor(self.cache.lengths, dtype=torch.long)  # [n]
        sizes = [len(t) for t in trees]
        width = max(sizes)
        at = int(lengths.max())
        ids = torch.empty(n, width, dtype=torch.long)
        depth = torch.empty(n, width, dtype=torch.long)
        # [n, T, T] query x new slot; a padding query sees its own slot only
        new = torch.eye(width, dtype=torch.bool).repeat(n, 1, 1)
        pad = torch.arange(width)
        for r, tree in enumerate(trees):
            size = sizes[r]
            ids[r] = tree.tokens[0]
            ids[r, :size] = torch.tensor(tree.tokens)
            depth[r] = pad
            depth[r, :size] = torch.tensor(tree.depths)
            new[r, :size, :size] = tree.ancestor_mask()
        positions = lengths[:, None] + depth  # [n, T]
        slots = at + width
        col = torch.arange(slots)
        full = (col[None, :] < lengths[:, None])[:, None, :].repeat(1, width, 1)  # [n, T, S]
        full[:, :, at:] = new
        layout = self.cache.layout
        masks: dict[str, torch.Tensor] = {}
        if FULL in layout.mask_types:
            masks[FULL] = full[:, None]
        if SLIDING in layout.mask_types:
            window = layout.window
            assert window is not None
            key_pos = col[None, :].repeat(n, 1)  # committed slot j is position j
            key_pos[:, at:] = positions
            near = (positions[:, :, None] - key_pos[:, None, :]) < window  # [n, T, S]
            masks[SLIDING] = (full & near)[:, None]
        device = self.device
        masks = {k: m.to(device) for k, m in masks.items()}
        mask = masks if layout.mixed else next(iter(masks.values()))
        packing: Packing | None = None
        if self._base is not None and sum(sizes) < n * width:
            packing = Packing.of(sizes, self._base, device)
            rows, cols = packing.rows.cpu(), packing.cols.cpu()
            ids, positions = ids[rows, cols][None], positions[rows, cols][None]  # [1, N]
        self.cache.begin_pass(0, n, at, width, packing)
        kwargs = {self.runner.cache_keyword: self.cache.hf}
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
        self._write_at = at
        self.last_rows = sum(sizes) if packing is not None else n * width
        self._hidden = None
        if packing is not None:
            logits = list(torch.split(out.logits[0], sizes))
        else:
            logits = [out.logits[r, :k] for r, k in enumerate(sizes)]
        if self.output_hidden:
            states = out.hidden_states
            hidden = torch.cat([states[i] for i in self.hidden_layers], -1)  # [n or 1, T, H]
            if packing is not None:
                self._hidden = list(torch.split(hidden[0], sizes))
            else:
                self._hidden = [hidden[r, :k] for r, k in enumerate(sizes)]
        return logits

    @torch.inference_mode()
    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        """Row ``r`` keeps the nodes ``paths[r]`` of its last verified tree."""
        self.cache.commit(self._write_at, paths)
        if self._hidden is not None:
            for r, path in enumerate(paths):
                self.features[r] = self._hidden[r][list(path)]
