"""The KV cache of a batch: every sequence's keys and values in one row of a padded buffer.

Layout, per attention layer: ``keys[row, head, slot, dim]`` (values likewise). Row ``r`` holds
its sequence's committed tokens (all but the last, the next root) at slots ``0 .. len_r - 1``,
slot ``j`` being position ``j``, exactly the single-sequence invariant of
:mod:`specdec.cache.kv`. A batched verification pass writes every row's new tokens at one common
offset ``W = max_r len_r``; a row shorter than ``W`` has a gap of stale slots between its end
and ``W``, which its attention mask hides. Committing a row moves its accepted path from
``W + path`` to ``len_r ..`` (one gather and one scatter per layer for the whole batch), so the
invariant holds again and a row's cache equals a fresh prefill of its committed tokens.

Why one common offset: the forward then writes all rows with a single slice assignment per
layer and the keys it attends over are one contiguous view ``[:, :, :W + T]``; per-row offsets
would need a scatter inside the model's attention. The price is that every row attends over
``W + T`` slots (masked where they are not its own), which is small next to the projections
for the contexts a CPU serves.

Rows in use are always the prefix ``0 .. n - 1`` (a leaving sequence's row is refilled with the
last one), so the pass over the batch is a view, never a copy. Buffers grow by doubling rows and
by 256-slot steps; they are zero-filled, because a masked slot still meets the values in
``softmax(scores) @ values`` and uninitialised memory could hold NaN (0 x NaN = NaN).

Sliding-window layers keep every slot too; the window is in their mask (see
:mod:`specdec.batch.target`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, DynamicLayer

from specdec.cache.layout import EMPTY, AttentionLayout

if TYPE_CHECKING:
    from specdec.batch.target import Packing

SLOT_STEP = 256  # slots are added in steps of this many (a copy of the used part per step)


class SlotLayer(DynamicLayer):
    """One attention layer's padded buffer; writes at the owner's common offset.

    Subclasses ``DynamicLayer`` so transformers treats it as the full-attention layer it is;
    ``keys``/``values`` are the whole buffers, so the length methods are overridden."""

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        rows, slots = self._owner.capacity
        _, heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros(rows, heads, slots, dim)
        self.values = value_states.new_zeros(rows, heads, slots, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[rows, heads, T, dim]`` new entries at the common offset; return the views
        the pass attends over, ``[rows, heads, W + T, dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.fit()
        assert self.keys is not None and self.values is not None
        lo, hi = self._owner.rows
        at = self._owner.write_at
        packing = self._owner.packing
        if packing is None:
            end = at + key_states.shape[-2]
            self.keys[lo:hi, :, at:end] = key_states
            self.values[lo:hi, :, at:end] = value_states
        else:  # [1, heads, N, dim]: each packed node to its row's slot at + node
            end = at + packing.width
            rows, slots = lo + packing.rows, at + packing.cols
            self.keys[rows, :, slots] = key_states[0].transpose(0, 1)
            self.values[rows, :, slots] = value_states[0].transpose(0, 1)
        return self.keys[lo:hi, :, :end], self.values[lo:hi, :, :end]

    def fit(self) -> None:
        """Grow the buffers to the owner's capacity (keeping their contents)."""
        if self.keys is None or self.values is None:
            return
        rows, slots = self._owner.capacity
        if self.keys.shape[0] >= rows and self.keys.shape[2] >= slots:
            return
        old_rows, old_slots = self.keys.shape[0], self.keys.shape[2]
        keys = self.keys.new_zeros(rows, self.keys.shape[1], slots, self.keys.shape[3])
        values = self.values.new_zeros(rows, self.values.shape[1], slots, self.values.shape[3])
        keys[:old_rows, :, :old_slots] = self.keys
        values[:old_rows, :, :old_slots] = self.values
        self.keys, self.values = keys, values

    def get_seq_length(self) -> int:
        return self._owner.write_at

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        packing = self._owner.packing
        return self._owner.write_at + (query_length if packing is None else packing.width), 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a slot cache is rolled back per row by SlotCache.commit")


class _HFSlotCache(Cache):
    def __init__(self, layers: list[CacheLayerMixin | DummyLayer]) -> None:
        Cache.__init__(self, layers=list(layers))


class SlotCache:
    """Rows of committed tokens in padded per-layer buffers; see the module doc.

    ``lengths[r]`` is how many entries row ``r`` holds; :meth:`begin_pass` sets which rows a
    forward covers and where it writes, :meth:`commit` keeps each row's accepted path."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.layout = AttentionLayout.from_config(config)
        self.capacity = (1, SLOT_STEP)  # (rows, slots) every layer's buffer has room for
        self.rows = (0, 0)  # the rows the current pass covers
        self.write_at = 0  # where the current pass writes
        self.packing: Packing | None = None  # how the current pass's nodes are packed
        self.lengths: list[int] = []  # entries per row in use
        self.hf = _HFSlotCache(
            [DummyLayer() if kind == EMPTY else SlotLayer(self) for kind in self.layout.layer_types]
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def _layers(self) -> list[SlotLayer]:
        return [layer for layer in self.hf.layers if isinstance(layer, SlotLayer)]

    def reserve(self, rows: int, slots: int) -> None:
        """Room for ``rows`` rows of ``slots`` slots (grown geometrically / in slot steps)."""
        have_rows, have_slots = self.capacity
        if rows <= have_rows and slots <= have_slots:
            return
        while have_rows < rows:
            have_rows *= 2
        if slots > have_slots:
            have_slots = -(-slots // SLOT_STEP) * SLOT_STEP
        self.capacity = (have_rows, have_slots)
        for layer in self._layers():
            layer.fit()

    def begin_pass(
        self, lo: int, hi: int, write_at: int, new_tokens: int, packing: Packing | None = None
    ) -> None:
        """The next forward covers rows ``lo .. hi - 1`` and writes ``new_tokens`` entries per
        row from slot ``write_at`` (a packed pass: its nodes, at their rows' slots)."""
        self.reserve(hi, write_at + new_tokens)
        self.rows = (lo, hi)
        self.write_at = write_at
        self.packing = packing

    def end_pass(self) -> None:
        self.packing = None

    def add_row(
        self, keys: Sequence[torch.Tensor | None], values: Sequence[torch.Tensor | None]
    ) -> int:
        """Append a row holding a prefilled sequence (per layer ``[heads, L, dim]``, ``None``
        for layers without entries); returns its index."""
        row = len(self.lengths)
        length = next((k.shape[-2] for k in keys if k is not None), 0)
        self.reserve(row + 1, length + 1)
        for layer, k, v in zip(self.hf.layers, keys, values, strict=True):
            if not isinstance(layer, SlotLayer) or k is None or v is None:
                continue
            if not layer.is_initialized:
                layer.lazy_initialization(k[None], v[None])
            assert layer.keys is not None and layer.values is not None
            layer.keys[row, :, :length] = k
            layer.values[row, :, :length] = v
        self.lengths.append(length)
        return row

    def remove_row(self, row: int) -> None:
        """Free ``row``; the last row moves into it (so rows in use stay a prefix)."""
        last = len(self.lengths) - 1
        if row != last:
            n = self.lengths[last]
            for layer in self._layers():
                if layer.keys is None or layer.values is None:
                    continue
                layer.keys[row, :, :n] = layer.keys[last, :, :n]
                layer.values[row, :, :n] = layer.values[last, :, :n]
            self.lengths[row] = n
        self.lengths.pop()

    def commit(self, write_at: int, paths: Sequence[Sequence[int]]) -> None:
        """Row ``r`` keeps, of the entries the last pass wrote from ``write_at``, those at
        offsets ``paths[r]`` (ascending, never empty: the root is always kept), moved to follow
        its committed entries."""
        n = len(paths)
        width = max(len(p) for p in paths)
        src_rows: list[list[int]] = []
        dst_rows: list[list[int]] = []
        moves = False
        for r, path in enumerate(paths):
            start = self.lengths[r]
            row_src = [write_at + p for p in path]
            row_dst = list(range(start, start + len(path)))
            moves = moves or row_src != row_dst
            pad = [row_src[-1]] * (width - len(path))  # the last entry onto itself: no move
            src_rows.append(row_src + pad)
            dst_rows.append(row_dst + pad)
            self.lengths[r] = start + len(path)
        if not moves:
            return
        src = torch.tensor(src_rows, dtype=torch.long)  # [n, width]
        dst = torch.tensor(dst_rows, dtype=torch.long)
        for layer in self._layers():
            if layer.keys is None or layer.values is None:
                continue
            device = layer.keys.device
            for buf in (layer.keys, layer.values):
                heads, dim = buf.shape[1], buf.shape[3]
                s = src.to(device)[:, None, :, None].expand(n, heads, width, dim)
                d = dst.to(device)[:, None, :, None].expand(n, heads, width, dim)
                moved = buf[:n].gather(2, s)  # every source read before any write
                buf[:n].scatter_(2, d, moved)

    def row_entries(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Row ``row``'s keys and values per layer (``[heads, len, dim]``), for tests."""
        n = self.lengths[row]
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in self.hf.layers:
            if isinstance(layer, SlotLayer) and layer.keys is not None and layer.values is not None:
                out.append((layer.keys[row, :, :n], layer.values[row, :, :n]))
            else:
                out.append(None)
        return out
