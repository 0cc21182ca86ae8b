"""The public decoding step: request state, proposal, the phases of a step and the emitter.

:class:`Decoder` owns a target, its speculator (or ``auto``'s arm controller) and the measured
costs; :class:`RequestState` is one request's state; :class:`Proposal` one step's draft before
verification; :class:`Emitter` turns accepted tokens into events. The single-request loop
(:mod:`specdec.engine`) and the batch scheduler (:mod:`specdec.batch`) both drive them."""

from specdec.decode.emitter import Emitter
from specdec.decode.state import Budget, Proposal, RequestState
from specdec.decode.step import Decoder, initial_costs

__all__ = ["Budget", "Decoder", "Emitter", "Proposal", "RequestState", "initial_costs"]
