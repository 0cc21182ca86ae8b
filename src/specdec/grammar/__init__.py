"""Constrained generation: the output must match a JSON schema, a regular expression or an
EBNF grammar, losslessly with respect to the grammar-masked target (see
:mod:`specdec.grammar.constraint`). The grammar engine (llguidance) is an optional extra."""

from specdec.grammar.backend import GrammarCompiler
from specdec.grammar.constraint import ConstrainedTree, GrammarConstraint, Matcher
from specdec.grammar.spec import Grammar

__all__ = ["ConstrainedTree", "Grammar", "GrammarCompiler", "GrammarConstraint", "Matcher"]
