"""The target seen by a batch: one forward pass verifies every sequence's draft tree.

Each sequence brings its own tree (chains and trees of any size), its own positions (its
committed length plus the node's depth), and its own mask over its own cache row: its committed
slots and, among the pass's new slots, its tree ancestors (see :mod:`specdec.batch.cache` for
the layout). Trees shorter than the longest are padded; a padding query sees only its own slot,
so no softmax row is empty, and its logits are dropped. Sliding-window layers get the same mask
cut to the window on each query's and key's own positions, as in :mod:`specdec.target.masks`.

Prefill runs beside the batch, one chunk per call, on a private single-sequence cache
(:class:`~specdec.target.ModelRunner`); a finished prefill is copied into a new row once. A
newcomer therefore delays the others by at most one chunk per step, never by its whole prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.batch.cache import SlotCache
from specdec.cache.layout import FULL, SLIDING
from specdec.target import LoadedModel, ModelRunner
from specdec.tree import DraftTree

DEFAULT_CHUNK = 64  # prompt tokens per prefill call


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

    def __init__(self, loaded: LoadedModel, *, chunk: int = DEFAULT_CHUNK) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.runner = ModelRunner(loaded.model)  # for its settings: device, dtype, hidden layers
        self.cache = SlotCache(loaded.model.config)
        self.chunk = chunk
        self.output_hidden = False
        self.hidden_layers: tuple[int, ...] = (-1,)
        self.features: list[torch.Tensor | None] = []  # per row, as HFTarget.features
        self._write_at = 0
        self._tree_sizes: list[int] = []

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
        width = max(len(t) for t in trees)
        at = int(lengths.max())
        ids = torch.empty(n, width, dtype=torch.long)
        depth = torch.empty(n, width, dtype=torch.long)
        # [n, T, T] query x new slot; a padding query sees its own slot only
        new = torch.eye(width, dtype=torch.bool).repeat(n, 1, 1)
        pad = torch.arange(width)
        for r, tree in enumerate(trees):
            size = len(tree)
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
        self.cache.begin_pass(0, n, at, width)
        out = self.model(
            input_ids=ids.to(device),
            position_ids=positions.to(device),
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=self.output_hidden,
            **{self.runner.cache_keyword: self.cache.hf},
        )
        self._write_at = at
        self._tree_sizes = [len(t) for t in trees]
        self._hidden: torch.Tensor | None = None
        if self.output_hidden:
            states = out.hidden_states
            self._hidden = torch.cat([states[i] for i in self.hidden_layers], -1)  # [n, T, H]
        return [out.logits[r, : len(t)] for r, t in enumerate(trees)]

    @torch.inference_mode()
    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        """Row ``r`` keeps the nodes ``paths[r]`` of its last verified tree."""
        self.cache.commit(self._write_at, paths)
        if self._hidden is not None:
            for r, path in enumerate(paths):
                self.features[r] = self._hidden[r, list(path)]
