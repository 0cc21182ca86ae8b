"""What ``--methods`` names: our engine's speculators and the Hugging Face baselines.

Every method runs on the same :class:`LoadedModel` object, so all of them use the same weights and
the same numerics (specdec's prepacked fp32 linears are modules of the model, which
``model.generate`` calls too). The only difference left is the decoding algorithm.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from specdec.bench.errors import UnknownMethodError
from specdec.config import GenerationConfig
from specdec.engine import SpeculativeEngine
from specdec.metrics import RequestStats
from specdec.speculators import available
from specdec.target import LoadedModel, early_exit_model, load_model

REFERENCE = "none"  # plain decoding by our engine: the reference for speedups and identity
HF_GREEDY = "hf"


@dataclass(frozen=True)
class MethodSpec:
    """One parsed ``--methods`` entry; ``label`` is the entry as written (the report's name)."""

    label: str
    backend: str  # "engine" | "hf"
    name: str  # engine speculator name, or the HF variant ("greedy", "prompt-lookup", "assisted")
    draft: str | None = None

    @property
    def lossless(self) -> bool:
        """Greedy output must equal plain greedy decoding (every method here is exact)."""
        return True


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


_HF_VARIANTS = {"hf": "greedy", "hf-prompt-lookup": "prompt-lookup", "hf-assisted": "assisted"}
_NEEDS_DRAFT = {"draft", "assisted", "medusa", "eagle"}
# methods whose optional argument (NAME:ARG) goes to this engine option
_OPTIONAL_ARG = {"lookahead": "lookahead", "suffix": "suffix_cache", "self": "self_draft"}
_OPTIONAL_ARG["auto"] = "auto_arms"  # auto:ARM+ARM=OPTION+...: see auto_options
_OPTIONAL_ARG["osd"] = "osd"  # osd:MEDUSA_DIR[@STATE_DIR]
_AUTO_ARM_OPTION = {**_OPTIONAL_ARG, "draft": "draft", "medusa": "medusa", "eagle": "eagle"}


def auto_options(arg: str) -> dict[str, Any]:
    """Engine options for ``auto:ARMS``: ``+``-separated speculators, each optionally with
    its option after ``=`` (``medusa=DIR[@TREE]``, ``draft=DIR|layers:N``, ``self=SPEC``,
    ``lookahead=WxNxG``, ``suffix=FILE``).

    >>> auto_options("suffix+medusa=heads@calibrated:8")
    {'auto_arms': 'suffix+medusa', 'medusa': 'heads', 'tree': 'calibrated:8'}
    """
    names: list[str] = []
    options: dict[str, str | None] = {}
    for item in arg.split("+"):
        name, _, value = item.partition("=")
        names.append(name)
        if value:
            if name not in _AUTO_ARM_OPTION or name == "auto":
                raise UnknownMethodError(f"speculator {name!r} in auto:{arg} takes no option")
            tree = ""
            if name == "medusa":
                value, _, tree = value.partition("@")
            options[_AUTO_ARM_OPTION[name]] = value
            if name == "medusa":
                options["tree"] = tree or None
    return {"auto_arms": "+".join(names), **options}


def parse_methods(
    text: str | Sequence[str], engine_methods: Sequence[str] | None = None
) -> list[MethodSpec]:
    """Parse ``none,prompt-lookup,draft:layers:8,hf,hf-prompt-lookup,hf-assisted:layers:8``.

    ``NAME:DRAFT`` gives a draft (``layers:N`` or a model directory) to ``draft`` and
    ``hf-assisted``, and a checkpoint to ``medusa`` (``medusa:DIR`` or ``medusa:DIR@TREE``
    with TREE a ``--tree`` value such as ``calibrated:64``), and ``eagle`` (``eagle:DIR`` or
    ``eagle:DIR@DEPTHxTOPKxTOTAL``). ``lookahead:WxNxG``,
    ``suffix:CACHE_FILE`` and ``self:LAYERS`` set those methods' options. The reference
    ``none`` is put first (added when missing), because every other method is compared with it
    on the same prompt.

    >>> [m.label for m in parse_methods("hf,prompt-lookup", ["none", "prompt-lookup"])]
    ['none', 'hf', 'prompt-lookup']
    """
    engine_methods = list(engine_methods if engine_methods is not None else available())
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
    items = [t for t in items if t]
    if not items:
        raise UnknownMethodError("--methods is empty; name at least one method")
    known = ", ".join([*engine_methods, "hf", "hf-prompt-lookup", "hf-assisted:DRAFT"])
    specs: list[MethodSpec] = []
    for item in items:
        base, _, draft = item.partition(":")
        if base in _HF_VARIANTS:
            spec = MethodSpec(item, "hf", _HF_VARIANTS[base], draft or None)
        elif base in engine_methods:
            spec = MethodSpec(item, "engine", base, draft or None)
        else:
            raise UnknownMethodError(f"unknown method {item!r}; known: {known}")
        if spec.name in _NEEDS_DRAFT and not spec.draft:
            hint = (
                f"{base}:/path/to/checkpoint"
                if spec.name in ("medusa", "eagle")
                else f"{base}:layers:N or {base}:/path/to/draft"
            )
            raise UnknownMethodError(f"method {item!r} needs a draft: write {hint}")
        if spec.name not in _NEEDS_DRAFT | set(_OPTIONAL_ARG) and spec.draft:
            raise UnknownMethodError(f"method {base!r} takes no draft (got {item!r})")
        if any(s.label == item for s in specs):
            raise UnknownMethodError(f"method {item!r} is listed twice")
        specs.append(spec)
    ref = [s for s in specs if s.label == REFERENCE]
    return (ref or [MethodSpec(REFERENCE, "engine", REFERENCE)]) + [
        s for s in specs if s.label != REFERENCE
    ]


class EngineRunner:
    """Our engine; ``none`` is plain decoding through the same loop."""

    def __init__(self, spec: MethodSpec, loaded: LoadedModel, num_draft_tokens: int) -> None:
        self.spec = spec
        options: dict[str, Any] = {"draft": spec.draft}
        if spec.name == "medusa" and spec.draft:
            path, _, tree = spec.draft.partition("@")
            options = {"medusa": path, "tree": tree or None}
        elif spec.name == "eagle" and spec.draft:
            path, _, tree = spec.draft.partition("@")
            options = {"eagle": path, "eagle_tree": tree or None}
        elif spec.name in _OPTIONAL_ARG:
            options = {_OPTIONAL_ARG[spec.name]: spec.draft}
        if spec.name == "auto" and spec.draft:
            options = auto_options(spec.draft)
        if spec.name == "osd" and spec.draft:  # osd:MEDUSA_DIR[@STATE_DIR]
            heads, _, state = spec.draft.partition("@")
            options = {"medusa": heads, "osd": state or None}
        self.engine = SpeculativeEngine.from_pretrained(
            loaded, method=spec.name, num_draft_tokens=num_draft_tokens, **options
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


def _draft_model(loaded: LoadedModel, draft: str) -> PreTrainedModel:
    if draft.startswith("layers:"):
        try:
            n = int(draft.split(":", 1)[1])
        except ValueError:
            raise UnknownMethodError(f"bad draft {draft!r}: expected layers:N") from None
        return early_exit_model(loaded.model, n)
    return load_model(draft, dtype=loaded.dtype_name).model


class HFRunner:
    """``model.generate`` greedy, with prompt lookup, or with an assistant model.

    The assistant drafts a constant ``K`` tokens per step (HF's confidence cut-off disabled) so
    that it drafts exactly what our ``draft`` method drafts.
    """

    def __init__(self, spec: MethodSpec, loaded: LoadedModel, num_draft_tokens: int) -> None:
        self.spec = spec
        self.model: Any = loaded.model  # generate() is untyped in transformers' stubs
        self.eos = sorted(loaded.eos_token_ids)
        self.kwargs: dict[str, Any] = _HF_KWARGS[spec.name](loaded, spec, num_draft_tokens)

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


def _assisted_kwargs(loaded: LoadedModel, spec: MethodSpec, k: int) -> dict[str, Any]:
    assert spec.draft is not None
    draft = _draft_model(loaded, spec.draft)
    gen = copy.deepcopy(draft.generation_config)
    gen.num_assistant_tokens = k
    gen.num_assistant_tokens_schedule = "constant"
    gen.assistant_confidence_threshold = 0.0
    draft.generation_config = gen
    return {"assistant_model": draft}


_HF_KWARGS: dict[str, Callable[[LoadedModel, MethodSpec, int], dict[str, Any]]] = {
    "greedy": lambda loaded, spec, k: {},
    "prompt-lookup": lambda loaded, spec, k: {"prompt_lookup_num_tokens": k},
    "assisted": _assisted_kwargs,
}
_BACKENDS: dict[str, Callable[[MethodSpec, LoadedModel, int], MethodRunner]] = {
    "engine": EngineRunner,
    "hf": HFRunner,
}


def build_runners(
    loaded: LoadedModel, specs: Sequence[MethodSpec], num_draft_tokens: int
) -> list[MethodRunner]:
    """One runner per method, all over ``loaded`` (built before anything is timed)."""
    return [_BACKENDS[s.backend](s, loaded, num_draft_tokens) for s in specs]
