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
    where the prompt ends, and the request's sampling settings and private RNG."""

    tokens: list[int]
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator


@dataclass(frozen=True)
class Feedback:
    """What verification made of the last proposal."""

    tree: DraftTree
    acceptance: Acceptance


class Speculator(Protocol):
    """Proposes a :class:`DraftTree` of at most ``budget`` drafted tokens per step.

    Class attributes declare capabilities: ``produces_q`` (drafts carry q for lossless sampling;
    otherwise they are deterministic, q = one-hot) and ``needs_hidden_states``.
    """

    name: ClassVar[str]
    produces_q: ClassVar[bool]
    needs_hidden_states: ClassVar[bool]

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
