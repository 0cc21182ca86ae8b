"""The single-request decoding loop and the library's entry point. ``stream`` is the only
loop; generate(), the CLI, server and bench use it. The step itself is
:class:`specdec.decode.Decoder`'s, which the batch scheduler drives too."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from os import PathLike
from typing import Any

import torch

from specdec.batch import generate_batch, generate_batch_ids
from specdec.config import GenerationConfig
from specdec.decode import Decoder, RequestState
from specdec.decode.step import DEFAULT_NUM_DRAFT_TOKENS
from specdec.events import GenerationResult, ResultBuilder, TokenEvent
from specdec.grammar import Grammar
from specdec.request import Prompt
from specdec.speculators import SpeculatorOptions, build_speculator, parse_spec
from specdec.speculators.auto import AutoOptions, build_arm_controller
from specdec.target import LoadedModel, load_model
from specdec.verify import TypicalAcceptanceRule


class SpeculativeEngine(Decoder):
    """Lossless speculative decoding over one target model.

    Every step drafts a tree, verifies it in one target forward pass, keeps the accepted path
    and adds one target-chosen token, so greedy output equals plain greedy decoding and sampled
    output follows exactly the target's (temperature/top-k/top-p shaped) distribution.

    Who drafts is decided in the step (:class:`~specdec.decode.Decoder`): one ``speculator``
    with the budget policy that sizes its drafts, or an
    :class:`~specdec.speculators.auto.ArmController` (``arms``) choosing among several
    speculators per step.
    """

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str | PathLike[str] | LoadedModel | None = None,
        *,
        gguf: str | PathLike[str] | None = None,
        speculator: str | SpeculatorOptions = "none",
        num_draft_tokens: int | None = None,
        dtype: str = "auto",
        adaptive: bool = True,
        typical_acceptance: bool = False,
        device: str = "cpu",
        chat_template: str | PathLike[str] | None = None,
    ) -> SpeculativeEngine:
        """Load a target (a local HF directory, a GGUF file, or the bundled default model when
        both are ``None``) and build the speculator ``speculator`` names: a spec such as
        ``"eagle:dir=heads,tree=5x4x24"`` or ``"auto:arms=prompt-lookup+suffix"`` (grammar:
        :mod:`specdec.speculators.spec`), or an options object. The spec is checked before the
        model loads, so a typo fails in milliseconds.

        ``num_draft_tokens`` is K, the most tokens drafted per step (a spec's ``k`` overrides
        it; ``None``: 5 for the adaptive budget, and a self-stopping chain keeps its own cap).
        ``typical_acceptance`` switches sampled requests to Medusa's typical acceptance,
        which is faster but LOSSY (statistics say so). ``device`` (``cpu``, ``cuda``,
        ``cuda:N``, ``auto``) is where a model loaded here runs; a given ``LoadedModel`` keeps
        its own. ``chat_template`` (a file or the template text) gives a model without one
        (many GGUF files) a chat template.
        """
        options = parse_spec(speculator)
        k = options.k or num_draft_tokens
        loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(
                model, gguf=gguf, dtype=dtype, device=device, chat_template=chat_template
            )
        )
        common: dict[str, Any] = {
            "num_draft_tokens": k,
            "loaded": loaded,
            "adaptive": adaptive,
            "acceptance_rule": TypicalAcceptanceRule() if typical_acceptance else None,
        }
        target = loaded.backend.verifier(loaded, threads=torch.get_num_threads())
        if isinstance(options, AutoOptions):
            arms = build_arm_controller(loaded, options, k or DEFAULT_NUM_DRAFT_TOKENS)
            return cls(target, loaded.tokenizer, arms=arms, **common)
        return cls(target, loaded.tokenizer, build_speculator(loaded, options), **common)

    # -- the loop -------------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | str = (),
        chat: bool | None = None,
        ignore_eos: bool = False,
        speculate: bool = True,
        grammar: Grammar | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> Iterator[TokenEvent]:
        """Yield one :class:`TokenEvent` per verification step, text as incremental deltas.

        ``speculate=False`` decodes plainly on the same target (the reference for speedups).
        ``grammar`` constrains the output (:class:`specdec.grammar.Grammar`), losslessly with
        respect to the grammar-masked target. ``logprobs`` adds each token's log-probability
        (and the ``top_logprobs`` most likely alternatives) to the events.
        Arguments are validated before the first token, so a bad request fails fast.
        """
        config = GenerationConfig.of(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        prompt_ids = self.encode(prompt, chat)
        return self.stream_ids(
            prompt_ids,
            config,
            speculate=speculate,
            grammar=grammar,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        *,
        speculate: bool = True,
        grammar: Grammar | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> Iterator[TokenEvent]:
        """:meth:`stream` for a prompt given as token ids and a ready configuration."""
        req = self.new_request(
            prompt_ids,
            config,
            speculate=speculate,
            grammar=grammar,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        return self.run(req)

    def run(self, req: RequestState) -> Iterator[TokenEvent]:
        """Decode ``req`` to its end on this engine's target, one event per step. The
        request's speculators learn from it when it ends, also when it is abandoned."""
        self.start(req)
        try:
            emitter = self.emitter(req)
            while True:
                event = emitter.emit(self.step(req))
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.end_request(req)

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Run :meth:`stream` to the end; same keyword arguments."""
        builder = ResultBuilder(bool(kwargs.get("logprobs")))
        for event in self.stream(prompt, **kwargs):
            builder.add(event)
        return builder.result(self.method if kwargs.get("speculate", True) else "none")

    def generate_batch(
        self, prompts: Sequence[Prompt], *, max_batch: int = 8, **kwargs: Any
    ) -> list[GenerationResult]:
        """Generate for many prompts at once with continuous batching (one target pass per step
        verifies every sequence's draft; :mod:`specdec.batch`). Each result equals what
        :meth:`generate` gives for its prompt alone (greedy: the same tokens; seeded sampling:
        the same draws). ``seeds`` gives each prompt its own seed; other keyword arguments as
        :meth:`generate`."""
        return generate_batch(self, prompts, max_batch=max_batch, **kwargs)

    def generate_batch_ids(
        self, prompt_ids: Sequence[Sequence[int]], *, max_batch: int = 8, **kwargs: Any
    ) -> list[GenerationResult]:
        """:meth:`generate_batch` for prompts given as token ids."""
        return generate_batch_ids(self, prompt_ids, max_batch=max_batch, **kwargs)
