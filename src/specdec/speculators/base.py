"""The Speculator protocol, the value objects across its seam, and the name registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import torch

from specdec.config import SamplingConfig, SpeculationConfig
from specdec.errors import UnknownSpeculatorError
from specdec.tree import DraftTree
from specdec.verify import Acceptance

if TYPE_CHECKING:
    from specdec.target import LoadedModel


@dataclass(frozen=True)
class DraftContext:
    """Everything a speculator may look at: committed tokens (the last one is the tree's root),
    where the prompt ends, the request's sampling settings and private RNG, and (for
    speculators that declare ``needs_hidden_states``) the target's hidden states (final, or the
    speculator's ``feature_layers`` concatenated) at the positions that produced the tokens
    committed last; the last row produced the root."""

    tokens: list[int]
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator
    features: torch.Tensor | None = None  # [M, H]


@dataclass(frozen=True)
class Feedback:
    """What verification made of the last proposal. ``logits`` are the target's logits at every
    tree node from that same pass (lookahead reads its Jacobi updates from them, so they cost no
    extra forward)."""

    tree: DraftTree
    acceptance: Acceptance
    logits: torch.Tensor | None = None  # [N, V]


class Speculator(Protocol):
    """Proposes a :class:`DraftTree` of at most ``budget`` drafted tokens per step.

    Class attributes declare capabilities: ``produces_q`` (drafts carry q for lossless sampling;
    otherwise they are deterministic, q = one-hot), ``needs_hidden_states`` (optionally with
    ``feature_layers``, the target hidden-state indices it reads, concatenated; default the
    final normed state ``(-1,)``), and
    ``drafts_trees`` (the budget counts tree nodes and is fixed at K, instead of a chain length
    the adaptive budget chooses per step).

    A speculator that learns across requests may also define
    ``end_request(tokens: list[int], prompt_len: int) -> None``; the engine calls it once when a
    request ends (finished, stopped or abandoned) with its prompt and committed output.

    A speculator that chooses among others (``auto``) may define ``bind_cost_model(costs)``,
    called once with the engine's :class:`~specdec.control.CostModel`, and ``last_choice``,
    the name of the speculator that drafted the last proposal (recorded in the statistics).
    """

    name: ClassVar[str]
    produces_q: ClassVar[bool]
    needs_hidden_states: ClassVar[bool]
    drafts_trees: ClassVar[bool]

    def propose(self, context: DraftContext, budget: int) -> DraftTree: ...

    def observe(self, feedback: Feedback) -> None: ...

    def reset(self) -> None: ...


SpeculatorFactory = Callable[["LoadedModel", SpeculationConfig], Speculator]
_REGISTRY: dict[str, SpeculatorFactory] = {}

F = TypeVar("F", bound=SpeculatorFactory)


def register(name: str) -> Callable[[F], F]:
    """Register a factory ``(target, config) -> Speculator`` under ``name``."""

    def deco(factory: F) -> F:
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def build_speculator(target: LoadedModel, config: SpeculationConfig) -> Speculator:
    try:
        factory = _REGISTRY[config.method]
    except KeyError:
        raise UnknownSpeculatorError(
            f"unknown method {config.method!r}; available: {', '.join(available())}"
        ) from None
    return factory(target, config)
