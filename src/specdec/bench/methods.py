"""What ``--methods`` names: our engine's speculators and the Hugging Face baselines.

A ``--methods`` value is a comma-separated list of specs in the one spec grammar of
:mod:`specdec.speculators.spec` (``none,eagle:dir=heads,tree=5x4x24,hf-assisted:layers:8``).
Hugging Face ``generate`` baselines are not speculators of our engine, so they have options
types of their own here (:data:`BASELINES`), consulted before the speculator registry; every
other name is a registered speculator, so a new one (or a third-party one) benchmarks with no
change here.

Every method runs on the same :class:`LoadedModel` object, so all of them use the same weights and
the same numerics (specdec's prepacked fp32 linears are modules of the model, which
``model.generate`` calls too). The only difference left is the decoding algorithm.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from transformers import PreTrainedModel

from specdec.bench.errors import UnknownMethodError
from specdec.config import GenerationConfig
from specdec.decode.step import DEFAULT_NUM_DRAFT_TOKENS
from specdec.engine import SpeculativeEngine
from specdec.metrics import RequestStats
from specdec.speculators.spec import (
    Registration,
    SpeculatorOptions,
    describe_options,
    option,
    parse_spec,
    split_specs,
)
from specdec.target import LoadedModel, early_exit_model, llamacpp, load_named

REFERENCE = "none"  # plain decoding by our engine: the reference for speedups and identity
LLAMACPP = "llamacpp"  # llama.cpp's plain decoding of the same file: the peer to beat


# -- the Hugging Face baselines' options ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HFOptions(SpeculatorOptions):
    """Base of the Hugging Face ``generate`` baselines; ``k`` is the tokens drafted per step
    (default: the benchmark's ``-k``, as for our speculators)."""

    def generate_kwargs(self, loaded: LoadedModel, k: int) -> dict[str, Any]:
        """Extra keyword arguments of ``model.generate`` for this baseline."""
        return {}


@dataclass(frozen=True, kw_only=True)
class HFGreedyOptions(HFOptions):
    """Hugging Face generate, greedy, no speculation (the "vs hf" reference)"""


@dataclass(frozen=True, kw_only=True)
class HFPromptLookupOptions(HFOptions):
    """Hugging Face prompt-lookup decoding (prompt_lookup_num_tokens=K)"""

    def generate_kwargs(self, loaded: LoadedModel, k: int) -> dict[str, Any]:
        return {"prompt_lookup_num_tokens": self.k or k}


@dataclass(frozen=True, kw_only=True)
class HFAssistedOptions(HFOptions):
    """Hugging Face assisted generation, the assistant drafting a constant K per step (an
    assistant with another tokenizer: universal assisted generation, text re-tokenised)"""

    primary = "draft"
    draft: str = option(
        help="the assistant: a model directory, GGUF file or pack alias, or layers:N of the target"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft.startswith("layers:"):
            n = self.draft.partition(":")[2]
            if not n.isdigit() or int(n) < 1:
                raise UnknownMethodError(
                    f"hf-assisted: bad draft {self.draft!r}; expected layers:N (N >= 1) or a "
                    "model directory"
                )

    def generate_kwargs(self, loaded: LoadedModel, k: int) -> dict[str, Any]:
        # Constant K, HF's confidence cut-off off: it drafts exactly what our `draft` drafts.
        draft, tokenizer = _draft_model(loaded, self.draft)
        gen = copy.deepcopy(draft.generation_config)
        gen.num_assistant_tokens = self.k or k
        gen.num_assistant_tokens_schedule = "constant"
        gen.assistant_confidence_threshold = 0.0
        draft.generation_config = gen
        kwargs: dict[str, Any] = {"assistant_model": draft}
        if tokenizer is not None and tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
            # universal assisted generation (transformers' UAG): both tokenizers, text between
            kwargs.update(tokenizer=loaded.tokenizer, assistant_tokenizer=tokenizer)
            _reread_last_token(draft)
        return kwargs


def _reread_last_token(assistant: PreTrainedModel) -> None:
    """Let universal assisted generation run to the end: when the target's new tokens bring
    no new assistant token (their text re-tokenises to what the assistant already read),
    transformers hands the assistant's ``generate`` a cache that holds its whole input, a pass
    of no tokens, and fails (``IndexError`` on the empty logits). Dropping the cache's last
    position makes that pass re-read one token, as assisted generation with one tokenizer
    always does; every other call is unchanged."""
    generate = cast("Callable[..., Any]", assistant.generate)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        ids, cache = kwargs.get("input_ids"), kwargs.get("cache")
        if ids is not None and cache is not None:
            extra = cache.get_seq_length() - ids.shape[-1] + 1
            if extra > 0:
                cache.crop(-extra)  # this cache takes the count to drop, negated
        return generate(*args, **kwargs)

    assistant.__dict__["generate"] = guarded  # this instance's, over the class's method


@dataclass(frozen=True, kw_only=True)
class LlamaCppOptions(SpeculatorOptions):
    """llama.cpp's plain greedy decoding of the target's GGUF file (what a user would otherwise
    run; its own numerics, so its output is timed, not required identical)"""


def _baseline(name: str, options: type[SpeculatorOptions]) -> Registration:
    summary = (options.__doc__ or "").strip().split("\n")[0]
    return Registration(name, options, None, summary)


BASELINES: dict[str, Registration] = {
    r.name: r
    for r in (
        _baseline("hf", HFGreedyOptions),
        _baseline("hf-prompt-lookup", HFPromptLookupOptions),
        _baseline("hf-assisted", HFAssistedOptions),
        _baseline(LLAMACPP, LlamaCppOptions),
    )
}
"""``--methods`` names that are baselines (Hugging Face ``generate``, llama.cpp), not
speculators of our engine."""


# -- parsing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """One parsed ``--methods`` entry; ``label`` is the spec as written (the report's name)."""

    label: str
    options: SpeculatorOptions

    @property
    def baseline(self) -> bool:
        """A baseline (Hugging Face ``generate``, llama.cpp) rather than our engine."""
        return isinstance(self.options, (HFOptions, LlamaCppOptions))

    @property
    def lossless(self) -> bool:
        """Greedy output must equal plain greedy decoding: every method on the target's own
        numerics; llama.cpp computes with its own kernels, so only its speed is compared."""
        return not isinstance(self.options, LlamaCppOptions)


def parse_method(text: str) -> MethodSpec:
    """One spec: a Hugging Face baseline or a registered speculator.

    >>> parse_method("hf-assisted:layers:8").options
    HFAssistedOptions(k=None, draft='layers:8')
    """
    return MethodSpec(text.strip(), parse_spec(text.strip(), BASELINES))


def parse_methods(text: str | Sequence[str]) -> list[MethodSpec]:
    """Parse ``none,prompt-lookup,draft:layers:8,hf,hf-prompt-lookup,hf-assisted:layers:8``.

    A string is split with :func:`~specdec.speculators.spec.split_specs` (a comma followed by
    ``key=`` continues the spec before it), so ``eagle:dir=d,tree=5x4x24`` is one entry. The
    reference ``none`` is put first (added when missing), because every other method is
    compared with it on the same prompt.

    >>> [m.label for m in parse_methods("hf,eagle:dir=d,tree=5x4x24")]
    ['none', 'hf', 'eagle:dir=d,tree=5x4x24']
    """
    items = split_specs(text) if isinstance(text, str) else [t.strip() for t in text]
    items = [t for t in items if t]
    if not items:
        raise UnknownMethodError("--methods is empty; name at least one method")
    specs: list[MethodSpec] = []
    for item in items:
        spec = parse_method(item)
        twin = next((s for s in specs if s.options == spec.options), None)
        if twin is not None:
            same = "twice" if twin.label == item else f"twice ({twin.label!r} is the same)"
            raise UnknownMethodError(f"method {item!r} is listed {same}")
        specs.append(spec)
    ref = [s for s in specs if s.label == REFERENCE]
    return (ref or [parse_method(REFERENCE)]) + [s for s in specs if s.label != REFERENCE]


def methods_help() -> str:
    """The ``--methods`` help text: the baselines with their options (speculators are listed
    by ``specdec speculators``)."""
    lines = ["Hugging Face baselines:"]
    for reg in BASELINES.values():
        primary = f" (NAME:VALUE sets {reg.options.primary})" if reg.options.primary else ""
        lines.append(f"  {reg.name}: {reg.summary}{primary}")
        for key, kind, text in describe_options(reg):
            if key != "k":  # listed once, under the speculators
                lines.append(f"      {key} ({kind}): {text}")
    return "\n".join(lines)


# -- running ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOutput:
    """One generation: output ids (EOS excluded), wall time including prefill, and engine stats."""

    token_ids: list[int]
    seconds: float
    finish_reason: str
    stats: RequestStats | None = None  # None for Hugging Face baselines


class MethodRunner(Protocol):
    spec: MethodSpec

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput: ...


class EngineRunner:
    """Our engine; ``none`` is plain decoding through the same loop."""

    def __init__(self, spec: MethodSpec, loaded: LoadedModel, num_draft_tokens: int | None) -> None:
        self.spec = spec
        self.engine = SpeculativeEngine.from_pretrained(
            loaded, speculator=spec.options, num_draft_tokens=num_draft_tokens
        )

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        config = GenerationConfig(max_new_tokens=max_new_tokens)
        tokens: list[int] = []
        stats = RequestStats()
        finish = "length"
        for event in self.engine.stream_ids(prompt_ids, config):
            tokens.extend(event.token_ids)
            stats = event.stats
            finish = event.finish_reason or finish
        return RunOutput(tokens, stats.seconds, finish, stats)


def _draft_model(loaded: LoadedModel, draft: str) -> tuple[PreTrainedModel, Any]:
    """The assistant model and its tokenizer (``None``: layers of the target, its own)."""
    if draft.startswith("layers:"):
        return early_exit_model(loaded.model, int(draft.partition(":")[2])), None
    # a GGUF target's own-block numerics need the assistant's file too: its own choice then
    dtype = "auto" if loaded.dtype_name == "kquant" else loaded.dtype_name
    assistant = load_named(draft, dtype=dtype)
    return assistant.model, assistant.tokenizer


class HFRunner:
    """``model.generate`` greedy, with prompt lookup, or with an assistant model."""

    def __init__(self, spec: MethodSpec, loaded: LoadedModel, num_draft_tokens: int | None) -> None:
        assert isinstance(spec.options, HFOptions)
        self.spec = spec
        self.model: Any = loaded.model  # generate() is untyped in transformers' stubs
        self.eos = sorted(loaded.eos_token_ids)
        self.kwargs = spec.options.generate_kwargs(
            loaded, num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS
        )

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, T]
        mask = torch.ones_like(ids)
        pad = self.eos[0] if self.eos else 0
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos or None,
                pad_token_id=pad,
                **self.kwargs,
            )
            seconds = time.perf_counter() - t0
        new = [int(t) for t in out[0, ids.shape[1] :].tolist()]
        for i, t in enumerate(new):
            if t in self.eos:  # our engine stops at EOS and does not emit it
                return RunOutput(new[:i], seconds, "stop")
        return RunOutput(new, seconds, "length")


class LlamaCppPlainRunner:
    """llama.cpp decoding the target's GGUF file plainly (:func:`llamacpp.plain_greedy`), on
    torch's thread count, as the engine's runs use."""

    def __init__(self, spec: MethodSpec, loaded: LoadedModel, num_draft_tokens: int | None) -> None:
        source = Path(loaded.source)
        if source.suffix.lower() != ".gguf" or not source.is_file():
            raise UnknownMethodError(
                f"method {LLAMACPP!r} runs the target's GGUF file in llama.cpp, and this target "
                f"({loaded.source}) has none: pass --gguf FILE, a model pack, or no --model"
            )
        if not llamacpp.available():
            raise UnknownMethodError(f"method {LLAMACPP!r}: {llamacpp.INSTALL_HINT}")
        self.spec = spec
        self.gguf = source
        self.stop = frozenset(loaded.eos_token_ids)

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        out = llamacpp.plain_greedy(
            self.gguf, prompt_ids, max_new_tokens, self.stop, torch.get_num_threads()
        )
        finish = "length" if len(out.token_ids) >= max_new_tokens else "stop"
        return RunOutput(out.token_ids, out.seconds, finish)


def build_runners(
    loaded: LoadedModel, specs: Sequence[MethodSpec], num_draft_tokens: int | None
) -> list[MethodRunner]:
    """One runner per method, all over ``loaded`` (built before anything is timed)."""
    runners: list[MethodRunner] = []
    for s in specs:
        if isinstance(s.options, LlamaCppOptions):
            runners.append(LlamaCppPlainRunner(s, loaded, num_draft_tokens))
        elif s.baseline:
            runners.append(HFRunner(s, loaded, num_draft_tokens))
        else:
            runners.append(EngineRunner(s, loaded, num_draft_tokens))
    return runners
