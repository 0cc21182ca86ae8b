"""Drive a Hugging Face causal LM through its public forward, over a rollback-able KV cache.

Used for the target (verification) and for draft models alike. Trees are scored in one pass with
explicit position ids (prefix length + depth) and a 4D mask in which every node sees the committed
prefix and its own ancestors only; chains use the model's own causal mask, the fast path.
Sliding-window layers get windowed masks (:mod:`specdec.target.masks`) whenever the window
matters.

Device: the runner works on the model's device. Per forward it copies to it only the token ids
and, for trees, the positions and the ancestor mask (small host-to-device copies); it reads
nothing back, since logits stay on the device for the acceptance rule.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdec.cache import KVCache
from specdec.errors import UnsupportedModelError
from specdec.target.masks import attention_masks
from specdec.tree import DraftTree


class TokenCache(Protocol):
    """The token ids a runner's KV cache holds, with the rollback a drafting chain needs."""

    @property
    def tokens(self) -> list[int]: ...

    def __len__(self) -> int: ...

    def rollback(self, length: int) -> None: ...

    def reset(self) -> None: ...


class TokenRunner(Protocol):
    """What a chain drafter or a cost calibration needs from a model with its own KV cache:
    feed tokens, read logits, roll back. :class:`ModelRunner` (torch) and
    :class:`specdec.target.llamacpp.LlamaCppRunner` both are one; what only torch offers (tree
    masks over the draft's cache, hidden states) stays on :class:`ModelRunner`."""

    @property
    def cache(self) -> TokenCache: ...

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def forward(self, tokens: Sequence[int], *, logits_to_keep: int = ...) -> torch.Tensor:
        """Append ``tokens`` to the cache; their logits (the last ``logits_to_keep``)."""
        ...

    def reset(self) -> None: ...

    def sibling(self) -> TokenRunner:
        """Another runner (its own KV cache) over the same weights."""
        ...


class ModelRunner:
    """A model plus its own KV cache. Holds no state on the model object itself."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            self._cache_kw = "cache"
        elif "past_key_values" in params:
            self._cache_kw = "past_key_values"
        else:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward takes no KV cache argument"
            )
        if "position_ids" not in params:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward takes no position_ids; trees need them"
            )
        self.cache = KVCache(model.config)
        first = next(model.parameters())
        self.dtype = first.dtype
        self.device = first.device
        self.output_hidden = False
        # which of the model's hidden_states to keep (index 0 = embeddings, i = output of layer
        # i-1, -1 = final normed state); several are concatenated along the feature axis
        self.hidden_layers: tuple[int, ...] = (-1,)
        self.last_hidden: torch.Tensor | None = None  # [T, H * len(hidden_layers)], when kept

    @property
    def cache_keyword(self) -> str:
        """The name of the model's KV-cache argument (``past_key_values`` or ``cache``)."""
        return self._cache_kw

    @property
    def context_length(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", 0) or 2048)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def reset(self) -> None:
        self.cache.reset()

    def sibling(self) -> ModelRunner:
        """Another runner (its own KV cache) over the same weights, for one more request."""
        return ModelRunner(self.model)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int],
        position_ids: torch.Tensor | None = None,  # [T]
        tree_mask: torch.Tensor | None = None,  # [T, T] bool, ancestors of each new token
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Append ``tokens`` to the cache and return their logits.  # [T or keep, V]

        With ``output_hidden`` set, also keeps the final hidden states (the LM head's input) of
        every token in ``last_hidden``, for feature-level speculators (Medusa, EAGLE)."""
        start = len(self.cache)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, T]
        if position_ids is None:
            position_ids = torch.arange(start, start + len(tokens), device=self.device)
        else:
            position_ids = position_ids.to(self.device, non_blocking=True)
        mask = attention_masks(self.cache.layout, start, position_ids, tree_mask)  # [1, 1, T, P+T]
        out = self.model(
            input_ids=ids,
            position_ids=position_ids[None],
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=self.output_hidden,
            **{self._cache_kw: self.cache.hf},
        )
        self.cache.appended(tokens)
        if self.output_hidden:
            states = out.hidden_states
            if len(self.hidden_layers) == 1:
                self.last_hidden = states[self.hidden_layers[0]][0]  # [T, H]
            else:
                self.last_hidden = torch.cat([states[i][0] for i in self.hidden_layers], -1)
        return out.logits[0]

    def forward_tree(self, tree: DraftTree) -> torch.Tensor:
        """Score every node of ``tree`` in one pass.  # [N, V]"""
        start = len(self.cache)
        if tree.is_chain:
            return self.forward(tree.tokens)
        return self.forward(
            tree.tokens, position_ids=tree.position_ids(start), tree_mask=tree.ancestor_mask()
        )

    def probe(self) -> None:
        """Reject, before any generation, a model the engine cannot drive losslessly.

        Checks that the cache can be rolled back exactly and that a 4D tree mask with explicit
        positions is honoured (a sibling's logits must equal those of its own chain).
        """
        self.reset()
        try:
            self.forward([0, 1])
            self.cache.check_rollback_supported()
            tree = DraftTree(tokens=(2, 3, 4), parents=(-1, 0, 0))
            tree_logits = self.forward_tree(tree)
            self.cache.rollback(2)
            chain_logits = self.forward([2, 4])
        except UnsupportedModelError:
            raise
        except Exception as e:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} cannot be driven with an explicit KV cache, "
                f"position ids and a 4D attention mask: {type(e).__name__}: {e}"
            ) from e
        finally:
            self.reset()
        tol = 1e-3 if self.dtype in (torch.float32, torch.float64) else 5e-2
        scale = float(chain_logits.abs().max()) + 1.0
        if not torch.allclose(tree_logits[2].float(), chain_logits[1].float(), atol=tol * scale):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} ignores the 4D tree attention mask or explicit "
                "position ids, so it cannot verify token trees"
            )
