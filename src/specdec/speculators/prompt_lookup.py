"""Prompt lookup decoding: draft the continuation of the latest earlier match of the last n tokens.

Deterministic drafts (q = one-hot), so they are lossless under sampling too. The index of n-grams
is updated incrementally (O(max n) per new token), so a step that finds nothing costs next to
nothing beyond the plain decoding step it becomes.
"""

from __future__ import annotations

from typing import ClassVar

from specdec.config import SpeculationConfig
from specdec.speculators.base import DraftContext, Feedback, register
from specdec.target import LoadedModel
from specdec.tree import DraftTree


class PromptLookupSpeculator:
    name: ClassVar[str] = "prompt-lookup"
    produces_q: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False
    drafts_trees: ClassVar[bool] = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        self.sizes = list(range(max_ngram, min_ngram - 1, -1))
        self.reset()

    def reset(self) -> None:
        # _last[n][ngram] = index of the ngram's last token, latest occurrence wins
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed_end = 0

    def _index(self, tokens: list[int], upto: int) -> None:
        for end in range(self._indexed_end, upto):
            for n in self.sizes:
                if end - n + 1 >= 0:
                    self._last[n][tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed_end = max(self._indexed_end, upto)

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        """Longest n first; the match must end before the current last token.

        >>> import torch
        >>> from specdec.config import SamplingConfig
        >>> ctx = DraftContext([5, 6, 7, 8, 5, 6], 6, SamplingConfig(), torch.Generator())
        >>> PromptLookupSpeculator().propose(ctx, 2).tokens
        (6, 7, 8)
        """
        tokens = context.tokens
        n_tok = len(tokens)
        if n_tok < self._indexed_end:  # context shrank: a new request without reset()
            self.reset()
        self._index(tokens, n_tok - 1)
        for n in self.sizes:
            if n > n_tok:
                continue
            end = self._last[n].get(tuple(tokens[n_tok - n :]))
            if end is not None:
                drafts = tokens[end + 1 : end + 1 + budget]
                if drafts:
                    return DraftTree.chain(tokens[-1], drafts)
        return DraftTree.root_only(tokens[-1])

    def observe(self, feedback: Feedback) -> None:
        pass


@register("prompt-lookup")
def _build(target: LoadedModel, config: SpeculationConfig) -> PromptLookupSpeculator:
    return PromptLookupSpeculator(config.prompt_lookup_max_ngram, config.prompt_lookup_min_ngram)
