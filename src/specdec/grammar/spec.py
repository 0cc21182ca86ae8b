"""The :class:`Grammar` value: what a request's output must match, before any engine compiles it.

A small frozen value (kind + source text) so it can travel through configs, the CLI and the
server unchanged and be compared and hashed; compiling it against a tokenizer is the grammar
engine's job (:mod:`specdec.grammar.backend`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from specdec.errors import InvalidRequestError

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf")


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output text: a JSON schema, any JSON object, a regular expression, or
    an EBNF grammar (Lark syntax, or llama.cpp's GBNF with ``::=`` rules).

    Build it with the constructors, which validate what they can without a tokenizer:

    >>> Grammar.regex("(a|b)+c")
    Grammar(kind='regex', source='(a|b)+c')
    >>> Grammar.json_schema({"type": "object"}).source
    '{"type":"object"}'
    """

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}",
                param="grammar",
            )
        if not isinstance(self.source, str):
            raise InvalidRequestError("a grammar's source must be text", param="grammar")
        if self.kind != "json_object" and not self.source.strip():
            raise InvalidRequestError(f"the {self.kind} grammar is empty", param="grammar")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """Output is JSON valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(
                    f"the JSON schema is not valid JSON: {e}", param="grammar"
                ) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(
                "a JSON schema must be a JSON object (or true/false)", param="grammar"
            )
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), sort_keys=False))

    @classmethod
    def json_object(cls) -> Grammar:
        """Output is one JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output matches ``pattern`` in full (Rust ``regex`` syntax, anchored at both ends)."""
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, text: str) -> Grammar:
        """Output derives from the grammar's ``start`` (Lark) or ``root`` (GBNF) rule."""
        return cls("ebnf", text)
