"""From accepted tokens to :class:`~specdec.events.TokenEvent` s."""

from __future__ import annotations

import time
from collections.abc import Set

from transformers import PreTrainedTokenizerBase

from specdec.decode.state import RequestState
from specdec.events import TokenEvent
from specdec.text import IncrementalDetokenizer, StopMatcher
from specdec.verify import Acceptance


class Emitter:
    """Turns a request's accepted tokens into :class:`TokenEvent` s: end of sequence, stop
    strings, the token limit, incremental text. One per request; the single-request loop and
    the batch scheduler share it."""

    def __init__(
        self,
        req: RequestState,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Set[int],
    ) -> None:
        self.req = req
        self.eos_token_ids = eos_token_ids
        self.detok = IncrementalDetokenizer(tokenizer, req.tokens)
        self.stopper = StopMatcher(req.config.stop)

    def emit(self, acceptance: Acceptance) -> TokenEvent:
        """Commit ``acceptance.tokens`` to the request (up to its end) and describe them."""
        req, config = self.req, self.req.config
        eos = self.eos_token_ids
        emitted: list[int] = []
        text, finish, stop_hit, eos_hit = "", None, False, None
        for token in acceptance.tokens:
            if token in eos and not config.ignore_eos:
                finish, eos_hit = "stop", token
                break
            emitted.append(token)
            req.tokens.append(token)
            delta, stop_hit = self.stopper.feed(self.detok.push(token))
            text += delta
            if stop_hit:
                finish = "stop"
                break
            if req.remaining <= 0:
                finish = "length"
                break
        if finish is not None and not stop_hit:
            delta, stop_hit = self.stopper.feed(self.detok.flush())
            text += delta
            if not stop_hit:
                text += self.stopper.flush()  # release text held back for a possible stop
        req.stats.new_tokens = len(req.tokens) - req.prompt_len
        req.stats.seconds = time.perf_counter() - req.started
        lps = None if req.logprobs is None else tuple(req.step_logprobs[: len(emitted)])
        return TokenEvent(tuple(emitted), text, finish, req.stats.snapshot(), lps, eos_hit)
