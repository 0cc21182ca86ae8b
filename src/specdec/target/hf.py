"""The engine's view of the target: begin a request, verify a tree, commit the accepted path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from specdec.errors import ConfigError
from specdec.target.base import LoadedModel, Target
from specdec.target.runner import ModelRunner
from specdec.tree import DraftTree

__all__ = ["HFTarget", "Target"]


class HFTarget:
    """A Hugging Face causal LM as target.

    Cache invariant: between steps the KV cache holds every committed token but the last, which
    is the root of the next tree and is fed with its drafts.
    """

    provides_features: ClassVar[bool] = True

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.runner = ModelRunner(loaded.model)
        self.runner.probe()
        self._start = 0
        self._features: torch.Tensor | None = None

    def enable_features(self, layers: Sequence[int] = (-1,)) -> None:
        """Keep hidden states from every pass for feature-level speculators: the final normed
        state by default (Medusa, EAGLE-1), or several layers' outputs concatenated (EAGLE-3's
        low/middle/high features; index i of the model's ``hidden_states``, 0 = embeddings)."""
        n = int(self.loaded.model.config.num_hidden_layers)
        for i in layers:
            if not -n - 1 <= i <= n:
                raise ConfigError(
                    f"hidden-state layer {i} is out of range: this model has {n} layers "
                    f"(valid indices {-n - 1}..{n})"
                )
        self.runner.output_hidden = True
        self.runner.hidden_layers = tuple(int(i) for i in layers)

    @property
    def features(self) -> torch.Tensor | None:
        return self._features

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    @property
    def device(self) -> torch.device:
        """The model's device: the engine's sampling generator lives there too."""
        return self.runner.device

    def begin(self, prompt: Sequence[int]) -> None:
        self.runner.reset()
        self._features = None
        if len(prompt) > 1:
            self.runner.forward(prompt[:-1], logits_to_keep=1)
            self._features = self.runner.last_hidden  # [T-1, H]

    def verify(self, tree: DraftTree) -> torch.Tensor:
        self._start = len(self.runner.cache)
        return self.runner.forward_tree(tree)  # [N, V]

    def commit(self, path: Sequence[int]) -> None:
        self.runner.cache.commit(self._start, path)
        hidden = self.runner.last_hidden
        self._features = None if hidden is None else hidden[list(path)]  # [len(path), H]
