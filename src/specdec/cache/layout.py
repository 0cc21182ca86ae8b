"""Which attention each decoder layer runs, and the cache layers that keep it rollback-able.

Hugging Face builds a ``DynamicSlidingWindowLayer`` for every sliding-window layer: it keeps only
the last ``window`` keys/values, so a rejected draft that pushed older entries out cannot be
undone, and a tree's accepted path cannot be compacted. specdec instead keeps *every* layer's
keys and values for the whole context in full (never evicting) layers and gives the sliding
layers their own windowed attention mask (:mod:`specdec.target.masks`), which computes exactly
what the windowed cache would, at the price of memory that grows with the context rather than
the window (see docs/models.md).

Layers whose state is recurrent (state-space, linear attention, convolutions) fold every token
into one state that cannot be un-folded, so they are refused with the layer type named.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from specdec.cache.buffer import BufferLayer
from specdec.errors import UnsupportedModelError

FULL = "full_attention"
SLIDING = "sliding_attention"
# layer types that hold no keys/values of their own (MLP/MoE-only layers, KV-sharing consumers)
EMPTY = "dummy"
SUPPORTED_LAYER_TYPES = (FULL, SLIDING, EMPTY)


@dataclass(frozen=True)
class AttentionLayout:
    """Per decoder layer: its attention type and, for sliding layers, its window (a query at
    position p sees keys at positions p - window + 1 .. p, as transformers' sliding mask does).
    """

    layer_types: tuple[str, ...]
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.layer_types) != len(self.windows):
            raise ValueError("one window entry per layer type is needed")
        for i, (kind, window) in enumerate(zip(self.layer_types, self.windows, strict=True)):
            if kind not in SUPPORTED_LAYER_TYPES:
                raise UnsupportedModelError(
                    f"layer {i} of this model is a {kind!r} layer, whose cache state cannot be "
                    "rolled back exactly (only full-attention and sliding-window attention "
                    "layers can); speculative decoding needs a decoder made of attention layers"
                )
            if kind == SLIDING and (window is None or window < 1):
                raise UnsupportedModelError(
                    f"layer {i} is a sliding-window layer without a positive window ({window!r})"
                )
        sizes = {
            w
            for k, w in zip(self.layer_types, self.windows, strict=True)
            if k == SLIDING and w is not None
        }
        if len(sizes) > 1:
            raise UnsupportedModelError(
                f"this model's sliding layers use several windows ({sorted(sizes)}); "
                "transformers takes one mask per layer type, so they cannot be masked exactly"
            )

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> AttentionLayout:
        """The layout transformers itself derives (``layer_types``, or ``sliding_window`` on
        configs without them, such as Mistral's)."""
        text = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text)
        windows = tuple(
            kw.get("sliding_window") if t == SLIDING else None
            for t, kw in zip(types, kwargs, strict=True)
        )
        return cls(tuple(types), windows)

    @property
    def window(self) -> int | None:
        """The sliding window, or ``None`` when no layer slides."""
        return next((w for w in self.windows if w is not None), None)

    @property
    def mask_types(self) -> tuple[str, ...]:
        """The distinct attention layer types, in first-seen order (the keys of a mask dict)."""
        seen: list[str] = []
        for kind in self.layer_types:
            if kind != EMPTY and kind not in seen:
                seen.append(kind)
        return tuple(seen)

    @property
    def mixed(self) -> bool:
        """Layers of both kinds: the model needs a mask per layer type (a dict), since one
        tensor would be applied to every layer."""
        return len(self.mask_types) > 1

    def cache_layers(self) -> list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer]:
        """Fresh cache layers: a full :class:`BufferLayer` (a ``DynamicLayer`` writing in place)
        for every attention layer, sliding or not (never evicting, so crop and compaction stay
        exact)."""
        return [DummyLayer() if kind == EMPTY else BufferLayer() for kind in self.layer_types]
