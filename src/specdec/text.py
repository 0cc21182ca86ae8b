"""Incremental detokenization and stop strings, without re-decoding the whole output per step."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns one token at a time into text deltas.

    Decodes only a short window (from the last emitted boundary) per token, and holds back text
    while it ends in an incomplete UTF-8 sequence (``\\ufffd``), so multi-byte characters split
    across tokens come out whole. A few prompt tokens seed the window, so the first output token's
    leading space is decoded as it would be mid-text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end of output: whatever is still held back, even an incomplete character."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds stop strings in streamed text and holds back text that may start one.

    ``feed`` returns the text safe to emit and whether a stop string was hit; on a hit the
    text before the stop string is returned and the stop string itself is never emitted.

    >>> m = StopMatcher(("END",))
    >>> m.feed("abcE"), m.feed("N"), m.feed("Dxyz")
    (('abc', False), ('', False), ('', True))
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        search_from = max(0, self.emitted - max(len(s) for s in self.stops))
        self.text += delta
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            cut = min(hits)
            out = self.text[self.emitted : cut]
            self.emitted = len(self.text)
            return out, True
        safe = len(self.text) - self._held_back()
        out = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return out, False

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
