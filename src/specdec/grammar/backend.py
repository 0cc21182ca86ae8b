"""The grammar engine adapter: llguidance (https://github.com/guidance-ai/llguidance).

Chosen over xgrammar and outlines-core by measurement on the bundled model's 49,152-token
vocabulary (docs/structured-output.md): the shortest JSON-schema compile time (its lexer is
built lazily), a per-token mask as fast as xgrammar's at the median, no dependencies
(xgrammar pulls in triton and a TVM runtime), one package for JSON schemas, regular
expressions, Lark and GBNF grammars, and cheap ``rollback``/``deep_copy`` for walking trees.

It is an optional extra (``pip install 'specdec[structured]'``); it is imported when the first
grammar is compiled, so nothing else depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.errors import ConfigError, InvalidRequestError
from specdec.grammar.constraint import GrammarConstraint
from specdec.grammar.spec import Grammar

INSTALL_HINT = "pip install 'specdec[structured]'  (installs llguidance)"
# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): llguidance's
# default lets whitespace run on without end, which a small model will do; a schema may ask
# otherwise through its "x-guidance" options
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"constrained generation needs the grammar engine llguidance: {INSTALL_HINT}"
        ) from None
    return llguidance


class _WordTokenizer:
    """What llguidance needs of a tokenizer without a byte-level decoder (word-level test
    tokenizers): each token's bytes, EOS/BOS, and an encoder."""

    def __init__(self, hf: Any, eos: int) -> None:
        self.eos_token_id = eos
        self.bos_token_id = hf.bos_token_id
        specials = set(getattr(hf, "all_special_ids", []))
        self.special_token_ids = sorted(specials)
        self.tokens = [
            b"" if i in specials else str(hf.convert_ids_to_tokens(i)).encode("utf-8")
            for i in range(len(hf))
        ]
        self._hf = hf

    def __call__(self, text: str | bytes) -> list[int]:
        """Greedy longest match over the tokens' bytes (llguidance tokenizes forced bytes
        with it, written without the word tokenizer's separating spaces); bytes no token
        starts with are skipped."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            best = max(
                (t for t, b in enumerate(self.tokens) if b and data.startswith(b, i)),
                key=lambda t: len(self.tokens[t]),
                default=None,
            )
            if best is None:
                i += 1
                continue
            out.append(best)
            i += len(self.tokens[best])
        return out


class _LLMatcher:
    """:class:`~specdec.grammar.constraint.Matcher` over an ``llguidance.LLMatcher``."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self._vocab = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def fill_mask(self, out: torch.Tensor) -> None:
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())

    def consume(self, token: int) -> bool:
        if self._m.validate_tokens([token]) != 1:
            return False
        return bool(self._m.consume_token(token))

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def forced_tokens(self) -> list[int]:
        return list(self._m.compute_ff_tokens())


class GrammarCompiler:
    """Compiles :class:`Grammar` values into per-request constraints for one tokenizer.

    Building llguidance's view of a 49k-token vocabulary takes most of a second, so one
    compiler serves every request of an engine; compiling a grammar is then cheap."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        ll = _llguidance()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        eos = sorted(self.eos_token_ids) or None
        try:
            self._tok = ll.hf.from_tokenizer(tokenizer, eos_token=eos)
        except ValueError:  # no byte-level decoder: describe the tokens ourselves
            wrapper = _WordTokenizer(tokenizer, eos[0] if eos else len(tokenizer) - 1)
            self._tok = ll.LLTokenizer(ll.TokenizerWrapper(wrapper), eos_token=eos)
        self._ll = ll

    def source(self, grammar: Grammar) -> str:
        """The llguidance grammar text for ``grammar``."""
        ll = self._ll
        if grammar.kind == "json_schema":
            return str(ll.LLMatcher.grammar_from_json_schema(grammar.source, JSON_OPTIONS))
        if grammar.kind == "json_object":
            return str(ll.LLMatcher.grammar_from_json_schema('{"type":"object"}', JSON_OPTIONS))
        if grammar.kind == "regex":
            return str(ll.LLMatcher.grammar_from_regex(grammar.source))
        try:
            return str(ll.grammar_from("ebnf", grammar.source))
        except ValueError as e:
            raise InvalidRequestError(f"invalid grammar: {e}", param="grammar") from None

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh constraint for one request; an invalid grammar raises
        :class:`InvalidRequestError` (param ``grammar``) before any decoding."""
        try:
            text = self.source(grammar)
        except ValueError as e:
            raise InvalidRequestError(f"invalid {grammar.kind}: {e}", param="grammar") from None
        matcher = self._ll.LLMatcher(self._tok, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid {grammar.kind} grammar: {matcher.get_error()}", param="grammar"
            )
        return GrammarConstraint(_LLMatcher(matcher, self._tok.vocab_size), self.eos_token_ids)
