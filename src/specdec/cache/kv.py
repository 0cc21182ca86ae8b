"""KV cache ownership: commit the accepted path, roll back everything else.

Invariant (tested): after any sequence of steps, entry j of every layer holds the keys/values of
``tokens[j]`` at position j, equal (within float tolerance) to what a fresh prefill of ``tokens``
would compute. The engine keeps the *target* cache at "all committed tokens but the last", because
the last committed token is the root of the next draft tree and is fed with it.

Sliding-window layers keep their whole history too (:mod:`specdec.cache.layout`): their window is
applied by the attention mask, not by evicting entries, so crop and compaction stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer

from specdec.cache.buffer import BufferLayer
from specdec.cache.layout import AttentionLayout
from specdec.errors import UnsupportedModelError


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix.

    >>> common_prefix_len([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = min(len(a), len(b))
    a, b = list(a[:n]), list(b[:n])  # slices compare in C: the auto controller asks every step
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _FullCache(DynamicCache):
    """A ``DynamicCache`` over given layers: a full :class:`BufferLayer` for every attention
    layer, sliding ones included (transformers would give those an evicting sliding layer)."""

    def __init__(self, layout: AttentionLayout) -> None:
        Cache.__init__(self, layers=layout.cache_layers())


class KVCache:
    """A Hugging Face ``DynamicCache`` plus the token ids it holds.

    Building it refuses a model whose layers cannot be rolled back (the error names the layer
    type); :attr:`layout` tells the runner which layers need a windowed mask."""

    def __init__(self, config: PretrainedConfig) -> None:
        self._config = config
        self.layout = AttentionLayout.from_config(config)
        self.hf: DynamicCache = _FullCache(self.layout)
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.hf = _FullCache(self.layout)
        self.tokens = []

    def check_rollback_supported(self) -> None:
        """Only full-attention layers (sliding ones are kept whole) can be cropped and compacted
        exactly; run after a forward, to catch a model that replaced our cache layers."""
        for layer in self.hf.layers:
            if type(layer) not in (BufferLayer, DynamicLayer, DummyLayer):
                raise UnsupportedModelError(
                    f"this model's cache uses {type(layer).__name__} layers, which cannot be "
                    "rolled back exactly; speculative decoding needs a decoder of full or "
                    "sliding-window attention layers"
                )

    def appended(self, tokens: Sequence[int]) -> None:
        """Record that the model has just written entries for ``tokens`` after the current end."""
        self.tokens.extend(int(t) for t in tokens)
        if self.hf.get_seq_length() != len(self.tokens):
            raise UnsupportedModelError(
                "the model did not append one KV entry per input token "
                f"(cache {self.hf.get_seq_length()}, tokens {len(self.tokens)})"
            )

    def rollback(self, length: int) -> None:
        """Drop every entry from ``length`` on."""
        drop = len(self.tokens) - length
        if drop < 0:
            raise ValueError(f"cannot roll back to {length}: cache holds {len(self.tokens)}")
        if drop:
            self.hf.crop(-drop)
            del self.tokens[length:]

    @torch.inference_mode()  # written in place, and the runner's entries are inference tensors
    def commit(self, start: int, keep: Sequence[int]) -> None:
        """Keep, of the entries written from ``start`` on, those at offsets ``keep`` (ascending).

        A chain's accepted path ``0..m`` is a crop; a tree's path is compacted into contiguous
        slots so that the invariant holds again.

        For example, of entries ``[P, P+1, P+2, P+3]`` for nodes 0..3, the path ``(0, 2, 3)``
        keeps ``P, P+2, P+3``.
        """
        keep = list(keep)
        if keep == list(range(len(keep))):
            self.rollback(start + len(keep))
            return
        end = start + len(keep)
        moved: dict[torch.device, torch.Tensor] = {}  # one host-to-device copy per device
        for layer in self.hf.layers:
            if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
                continue  # no entries of its own (MLP-only, KV-sharing, or a skipped slot)
            device = layer.keys.device
            if device not in moved:
                moved[device] = torch.tensor(keep, dtype=torch.long, device=device) + start
            idx = moved[device]
            # in place (the gather copies before the write), then a shorter view: a buffer
            # layer keeps its buffers, and nothing the size of the context is copied
            layer.keys[..., start:end, :] = layer.keys[..., idx, :]
            layer.values[..., start:end, :] = layer.values[..., idx, :]
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]
        self.tokens = self.tokens[:start] + [self.tokens[start + k] for k in keep]
