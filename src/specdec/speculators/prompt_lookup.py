"""Prompt lookup decoding: draft the continuation of the latest earlier match of the last n tokens.

Deterministic drafts (q = one-hot), so they are lossless under sampling too. The index of n-grams
is updated incrementally (O(max n) per new token), so a step that finds nothing costs next to
nothing beyond the plain decoding step it becomes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.errors import ConfigError
from specdec.speculators.base import DraftContext, Speculator
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.target import LoadedModel
from specdec.tree import DraftTree


@dataclass(frozen=True, kw_only=True)
class PromptLookupOptions(SpeculatorOptions):
    max_ngram: int = option(3, help="longest n-gram of the latest tokens looked up")
    min_ngram: int = option(2, help="shortest n-gram tried when longer ones find no match")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(
                "prompt-lookup n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got "
                f"min_ngram={self.min_ngram} max_ngram={self.max_ngram}"
            )


class PromptLookupSpeculator(Speculator):
    name: ClassVar[str] = "prompt-lookup"

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


@register("prompt-lookup", PromptLookupOptions)
def _build(target: LoadedModel, options: PromptLookupOptions) -> PromptLookupSpeculator:
    """drafts the continuation of the latest earlier match of the last n tokens (free)"""
    return PromptLookupSpeculator(options.max_ngram, options.min_ngram)
