"""The Speculator base class: every hook the engine may call, declared. The value objects across
its seam (:class:`DraftContext`, :class:`Feedback`) live in :mod:`specdec.drafting`; names and
options in :mod:`specdec.speculators.spec`."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, ClassVar

from specdec.config import SamplingConfig
from specdec.drafting import DraftContext, Feedback
from specdec.errors import UnknownSpeculatorError
from specdec.speculators.spec import (
    SpeculatorOptions,
    parse_spec,
    registration,
    speculator_name,
)
from specdec.tree import DraftTree

if TYPE_CHECKING:
    from specdec.target import LoadedModel

__all__ = ["DraftContext", "Feedback", "Speculator", "build_speculator"]


class Speculator:
    """Proposes a :class:`DraftTree` of at most ``budget`` drafted tokens per step.

    Subclass it and override :meth:`propose`; every other hook the engine (or the controller
    choosing among several speculators) may call is declared here with a no-op default, so
    nothing is discovered by probing. Class attributes declare capabilities:

    * ``drafts``: it proposes tokens at all (``none`` does not: a request it serves is plain
      decoding, and the batch scheduler gives it no draft budget);
    * ``produces_q``: drafts carry q for lossless sampling (otherwise they are deterministic,
      q = one-hot);
    * ``needs_hidden_states``: the context carries the target's hidden states at
      ``feature_layers`` (concatenated; default the final normed state ``(-1,)``);
    * ``drafts_trees``: the budget counts tree nodes and is fixed at K (the speculator sizes
      its own tree, from ``context.costs``), instead of a chain length the adaptive budget
      chooses per step;
    * ``drafts_by_model``: drafting runs a model and costs real time, so a controller decides
      before asking for a draft (the others propose first and are priced on their draft);
    * ``watches``: :meth:`watch` wants every step's committed tokens (and states), including
      steps another speculator drafted; ``watch_batches``: it may take many steps in one call;
    * ``truncatable``: the first n nodes of a draft are a draft it stands by (the batch budget
      may cut a draft to the batch's length); lookahead's Jacobi window is not.
    """

    name: ClassVar[str] = ""
    drafts: ClassVar[bool] = True
    produces_q: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False
    drafts_trees: ClassVar[bool] = False
    drafts_by_model: ClassVar[bool] = False
    watches: ClassVar[bool] = False
    watch_batches: ClassVar[bool] = False
    truncatable: ClassVar[bool] = True
    feature_layers: tuple[int, ...] = (-1,)

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        raise NotImplementedError(f"{type(self).__name__} must implement propose()")

    def observe(self, feedback: Feedback) -> None:
        """What verification made of this speculator's last proposal."""

    def reset(self) -> None:
        """A new request starts (per-request state goes; what is learnt across requests stays)."""

    def end_request(self, tokens: list[int], prompt_len: int) -> None:
        """A request ended (finished, stopped or abandoned) with these prompt + output tokens;
        for speculators that learn across requests."""

    def watch(self, context: DraftContext) -> None:
        """A step's committed context when another speculator drafts (see ``watches``)."""

    def fork(self) -> Speculator:
        """An instance for one more concurrent request (batched decoding keeps one per
        sequence): it shares what is learnt across requests (weights, a global suffix cache,
        an online learner) and owns its per-request state. The default is a shallow copy that
        :meth:`reset` then gives fresh per-request state, which is right for speculators whose
        ``reset`` *replaces* (not mutates) that state; one that owns a KV cache overrides it."""
        clone = copy.copy(self)
        clone.reset()
        return clone

    def chain_cap(self, sampling: SamplingConfig) -> int | None:
        """For a chain speculator that sizes its own chains token by token (it sees each
        token's confidence, which a length chosen before drafting cannot): the most tokens it
        drafts in a step, and the engine then only caps that by the request's remaining tokens
        and context room. ``None`` (the default): the engine's budget sizes the draft."""
        return None

    def pending_catch_up(self, context: DraftContext) -> int:
        """Committed tokens this speculator would read before its next draft (a draft model
        that has not seen the prompt, or the steps it skipped), beyond the one or two every
        draft reads: what the ``auto`` controller prices as a one-off cost. 0 by default."""
        return 0

    def catch_up_seconds(self) -> float:
        """Seconds of the last :meth:`propose` spent catching up on committed context (a draft
        model reading the tokens it had not seen) rather than drafting. Pricing leaves it out
        of the per-token drafting cost: after steps without drafts the catch-up grows with the
        gap, and charging it to the next draft's tokens would price drafting out of reach
        exactly when it stopped (the adaptive budget then never drafts again)."""
        return 0.0


def build_speculator(target: LoadedModel, options: SpeculatorOptions | str) -> Speculator:
    """The speculator ``options`` (an options object or a spec string) names, over ``target``."""
    options = parse_spec(options)
    reg = registration(speculator_name(options))
    if reg.factory is None:
        raise UnknownSpeculatorError(
            f"{reg.name!r} chooses among speculators and is built by the engine, not as one "
            "speculator; pass it to SpeculativeEngine.from_pretrained(speculator=...)"
        )
    return reg.factory(target, options)
