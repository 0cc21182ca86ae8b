"""The KV cache of a batch: every sequence's keys and values in one row of a padded buffer.

Layout, per attention layer: ``keys[row, head, slot, dim]`` (values likewise). Row ``r`` holds
its sequence's committed tokens (all but the last, the next root) at slots ``0 .. len_r - 1``,
slot ``j`` being position ``j``, exactly the single-sequence invariant of
:mod:`specdec.cache.kv`. A verification pass writes each row's new tokens beyond its committed
ones, and committing keeps the accepted path and moves it to follow them, so the invariant
holds again and a row's cache equals a fresh prefill of its committed tokens.

Where a pass writes depends on its layout:

- **packed** (the trees' nodes packed into one sequence, :mod:`specdec.batch.target`): node
  ``c`` of row ``r`` goes to slot ``len_r + c``, its row's own next slots. A chain accepted
  from its start, and every prompt token a pass prefills, is then already where it belongs:
  commit moves nothing for it (copying a 64-token prompt chunk from a common offset cost more
  than a third of the pass that computed it).
- **padded** (every row as wide as the widest): all rows write at one common offset
  ``W = max_r len_r``, with a single slice assignment per layer; a row shorter than ``W`` has a
  gap of stale slots between its end and ``W``, which its attention mask hides.

Either way a row attends over one contiguous view ``[:, :, :span]`` of the buffers, masked
where slots are not its own, which is small next to the projections for the contexts a CPU
serves.

Rows in use are always the prefix ``0 .. n - 1`` (a leaving sequence's row is refilled with the
last one), so the pass over the batch is a view, never a copy. Buffers grow by doubling rows and
by 256-slot steps; they are zero-filled, because a masked slot still meets the values in
``softmax(scores) @ values`` and uninitialised memory could hold NaN (0 x NaN = NaN).

Sliding-window layers keep every slot too; the window is in their mask (see
:mod:`specdec.batch.target`).
"""

from __future__ import annotations

import weakref
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
    """One attention layer's padded buffer; writes where the owner's pass says.

    Subclasses ``DynamicLayer`` so transformers treats it as the full-attention layer it is;
    ``keys``/``values`` are the whole buffers, so the length methods are overridden.

    The layer refers to its owner weakly: the owner holds its layers, and a strong reference
    back would make every cache a reference cycle, whose buffers (a whole batch's keys and
    values) only Python's rare full garbage collections free. A long batch job (data
    generation: a fresh scheduler per batch) then kept one cache per batch until it ran out of
    memory (docs/batching.md)."""

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self._owner_ref = weakref.ref(owner)

    @property
    def _owner(self) -> SlotCache:
        owner = self._owner_ref()
        if owner is None:
            raise RuntimeError("this cache layer's SlotCache is gone")
        return owner

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
        """Write the pass's new entries (padded: ``[rows, heads, T, dim]`` at the common offset;
        packed: ``[1, heads, N, dim]``, each node at its row's next slots); return the views the
        pass attends over, ``[rows, heads, span, dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.fit()
        assert self.keys is not None and self.values is not None
        lo, hi = self._owner.rows
        end = self._owner.span
        packing = self._owner.packing
        if packing is None:
            at = self._owner.write_at
            self.keys[lo:hi, :, at : at + key_states.shape[-2]] = key_states
            self.values[lo:hi, :, at : at + key_states.shape[-2]] = value_states
        else:  # [1, heads, N, dim]: each packed node to its slot
            rows = lo + packing.rows
            self.keys[rows, :, packing.slots] = key_states[0].transpose(0, 1)
            self.values[rows, :, packing.slots] = value_states[0].transpose(0, 1)
        return self.keys[lo:hi, :, :end], self.values[lo:hi, :, :end]

    def room(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The buffers of the pass's only row (``[1, heads, slots, dim]``) and the slot it
        writes from, for a caller that writes the ``tokens`` new entries itself and attends
        over them (the kquant decoder layer in one extension call, as on a single sequence's
        cache); ``None`` where :meth:`update` must run: a pass of several rows, a packed pass,
        the first entries, a buffer without the room."""
        owner = self._owner
        lo, hi = owner.rows
        keys, values = self.keys, self.values
        if hi - lo != 1 or owner.packing is not None or keys is None or values is None:
            return None
        at = owner.write_at
        if owner.span != at + tokens or at + tokens > keys.shape[2]:
            return None
        if keys.is_inference() and not torch.is_inference_mode_enabled():
            return None
        return keys[lo : lo + 1], values[lo : lo + 1], at

    def extend_to(self, n: int) -> None:
        """Nothing to record: the owner's :meth:`SlotCache.commit` keeps each row's length."""

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
        return self._owner.span, 0

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
        self.write_at = 0  # where the current pass writes (padded) / the longest row (packed)
        self.span = 0  # slots the current pass attends over
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
        self, lo: int, hi: int, write_at: int, span: int, packing: Packing | None = None
    ) -> None:
        """The next forward covers rows ``lo .. hi - 1`` and attends over ``span`` slots; a
        padded pass writes its entries from slot ``write_at`` in every row, a packed one each
        node at ``packing.slots``."""
        self.reserve(hi, span)
        self.rows = (lo, hi)
        self.write_at = write_at
        self.span = span
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

    def commit(self, sources: Sequence[Sequence[int]]) -> None:
        """Row ``r`` keeps the entries the last pass wrote at slots ``sources[r]`` (in path
        order, never empty: the root is always kept), moved to follow its committed entries.
        Entries already in place (a packed pass's prompt tokens, a chain accepted from its
        start) are not touched; the others move in one gather and one scatter per buffer."""
        moving: list[tuple[int, list[int], list[int]]] = []
        for r, kept in enumerate(sources):
            start = self.lengths[r]
            target = list(range(start, start + len(kept)))
            if list(kept) != target:
                first = next(i for i, (a, b) in enumerate(zip(kept, target, strict=True)) if a != b)
                moving.append((r, list(kept[first:]), target[first:]))
            self.lengths[r] = start + len(kept)
        if not moving:
            return
        width = max(len(f) for _, f, _ in moving)
        rows = torch.tensor([r for r, _, _ in moving], dtype=torch.long)[:, None]  # [m, 1]
        # short paths padded with their last move repeated (the same value to the same slot)
        src = torch.tensor([f + [f[-1]] * (width - len(f)) for _, f, _ in moving])  # [m, w]
        dst = torch.tensor([t + [t[-1]] * (width - len(t)) for _, _, t in moving])
        for layer in self._layers():
            if layer.keys is None or layer.values is None:
                continue
            device = layer.keys.device
            r_d, s_d, d_d = rows.to(device), src.to(device), dst.to(device)
            for buf in (layer.keys, layer.values):
                moved = buf[r_d, :, s_d]  # [m, w, heads, dim]: a copy, read before any write
                buf[r_d, :, d_d] = moved

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
