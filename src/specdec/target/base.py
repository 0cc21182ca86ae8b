"""The types every model backend shares: the loaded model, the engine's view of a target, and
the backend that connects them, with the registry that maps a ``--dtype`` to its backend.

Why one place: a model's numerics decide more than its weights (which verifier runs it, whether
the batch scheduler, token trees or hidden-state speculators can use it), and those decisions
used to compare dtype strings wherever they were needed. Each backend now says what it can do
(:class:`Backend`), each loaded model carries its backend, and only the registry here looks a
dtype name up. Backends register themselves from :mod:`specdec.target.backends`; this module
imports none of them, so it sits below everything that loads models.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.errors import ConfigError
from specdec.target.lowbit import weight_bytes
from specdec.target.runner import TokenRunner
from specdec.tree import DraftTree


class Target(Protocol):
    """What the engine needs from a target; the tests drive the engine with table-driven fakes.

    ``provides_features``: :meth:`enable_features` works and :attr:`features` then holds the
    hidden states feature-reading speculators draft from."""

    provides_features: ClassVar[bool]

    @property
    def context_length(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where the logits live; the request's sampling generator is made there."""
        ...

    def begin(self, prompt: Sequence[int]) -> None: ...

    def verify(self, tree: DraftTree) -> torch.Tensor: ...

    def commit(self, path: Sequence[int]) -> None: ...

    def enable_features(self, layers: Sequence[int] = (-1,)) -> None: ...

    @property
    def features(self) -> torch.Tensor | None:
        """Final hidden states at the positions that produced the tokens committed by the last
        ``begin``/``commit`` (the last row produced the next root), or ``None`` when this
        target does not collect them.  # [M, H]"""
        ...


@dataclass
class LoadedModel:
    """A ready-to-run model, its tokenizer, and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str
    numerics: str
    dtype_name: str
    # why ``--dtype auto`` did not run the file's own blocks (and what that costs), if it did not
    numerics_note: str | None = None
    # how it runs (which verifier, what it can do): the registered backend of ``dtype_name``
    backend: Backend = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.backend = backend_for(self.dtype_name)

    @property
    def device(self) -> torch.device:
        """Where the model's weights live; everything the engine creates goes there too."""
        return next(self.model.parameters()).device

    @property
    def config(self) -> Any:
        """The model's transformers config (shapes, layer count, vocabulary size)."""
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return self.model.generation_config

    def weight_bytes(self) -> int:
        """Bytes of the linear layers' weights a decoding step reads (the cost models' prior)."""
        return weight_bytes(self.model)

    def parameter_count(self) -> int:
        """Weights a forward reads: parameters plus prepacked linears' opaque weights (the fast
        float32 path keeps those outside ``parameters()``)."""
        total = sum(p.numel() for p in self.model.parameters())
        for m in self.model.modules():
            opaque = not isinstance(getattr(m, "weight", None), torch.Tensor)
            if hasattr(m, "in_features") and opaque:
                shape = cast(_LinearShape, m)
                total += int(shape.in_features) * int(shape.out_features)
        return total

    def _embedding_digest(self) -> str:
        """sha256 of the table's bfloat16 bits, row after row, read in slices: a table kept
        quantised (``KQuantEmbedding``) is dequantised a slice at a time, never whole."""
        embedding = self.model.get_input_embeddings()
        slice_of = getattr(embedding, "rows", None)
        if not callable(slice_of):
            weight = embedding.weight
            assert isinstance(weight, torch.Tensor)

            def slice_of(start: int, stop: int) -> torch.Tensor:
                return weight[start:stop]

        h = hashlib.sha256()
        total = int(cast(int, embedding.num_embeddings))
        for start in range(0, total, 8192):
            rows = slice_of(start, min(total, start + 8192)).detach()
            h.update(rows.to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tobytes())
        return h.hexdigest()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS plus every EOS of the generation config (chat models often end
        turns with a token other than the tokenizer's EOS)."""
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = getattr(self.generation_config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return frozenset(ids)

    def identity(self) -> dict[str, Any]:
        """What a trained speculator records about its target, so that loading it for another
        model fails loudly: architecture, shapes, and a digest of the token embeddings (which
        differ between any two distinct checkpoints). The digest is taken after rounding to
        bfloat16, so the same model loaded with another ``--dtype`` keeps its identity."""
        cfg = self.config
        digest = self._embedding_digest()
        return {
            "architecture": (getattr(cfg, "architectures", None) or [self._class_name()])[0],
            "model_type": getattr(cfg, "model_type", ""),
            "hidden_size": int(cfg.hidden_size),
            "num_hidden_layers": int(cfg.num_hidden_layers),
            "vocab_size": int(cfg.vocab_size),
            "embedding_sha256": digest[:32],
            "source": Path(self.source).name,
        }

    def _class_name(self) -> str:
        return type(self.model).__name__


def identity_mismatch(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Which recorded identity field differs (``source`` is informational only), or ``None``."""
    for key, value in expected.items():
        if key != "source" and key in actual and actual[key] != value:
            return f"{key} is {actual[key]!r} here but {value!r} in the checkpoint"
    return None


class _LinearShape(Protocol):
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelSource:
    """What :func:`specdec.target.load_model` was asked to load, before any backend reads it:
    a model directory or pack alias (``model``), or a GGUF file, or neither (the bundled
    model); where the cache lives, the device, and a chat template to use instead of the
    tokenizer's."""

    model: str | os.PathLike[str] | None = None
    gguf: str | os.PathLike[str] | None = None
    cache_dir: Path | None = None
    device: str | torch.device = "cpu"
    chat_template: str | os.PathLike[str] | None = None


class Backend(abc.ABC):
    """One numerics family: how its models load, which verifier runs them, and what they can
    do. One instance per family is registered (:mod:`specdec.target.backends`).

    Capabilities, read by the engine, the batch scheduler and the speculators instead of the
    dtype name:

    - ``batching``: :class:`specdec.batch.BatchTarget` can verify several requests of it in one
      pass (it needs the torch module).
    - ``trees``: token trees are drafted and verified in one pass with a 4D mask; without it a
      draft of this backend drafts chains only (a verifier still takes trees, branch by branch).
    - ``features``: its verifier keeps hidden states (EAGLE, Medusa draft from them).
    - ``devices``: the device types some of its dtypes run on (each dtype's own kernels are
      checked when it loads: :func:`specdec.target.numerics.check_numerics_device`).
    - ``threads``: its verifier takes a thread count of its own (torch's are process-wide).
    """

    name: ClassVar[str]
    dtypes: ClassVar[tuple[str, ...]]  # the --dtype values it runs, the default first
    batching: ClassVar[bool] = True
    trees: ClassVar[bool] = True
    features: ClassVar[bool] = True
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    threads: ClassVar[bool] = False

    @abc.abstractmethod
    def load(self, dtype: str, source: ModelSource) -> LoadedModel:
        """Load ``source`` to run in ``dtype`` (one of :attr:`dtypes`)."""

    @abc.abstractmethod
    def verifier(self, loaded: LoadedModel, threads: int | None = None) -> Target:
        """The engine's verifier of ``loaded``; ``threads`` where :attr:`threads` says it
        takes them (``None``: as many as torch uses)."""

    @abc.abstractmethod
    def verification_runner(
        self, loaded: LoadedModel, threads: int | None = None
    ) -> tuple[TokenRunner, Callable[[DraftTree], torch.Tensor]]:
        """A runner over ``loaded`` and the function that verifies a tree with it, the same
        passes as :meth:`verifier`'s, for timing them (:mod:`specdec.control.calibration`)."""

    def is_reference(self, dtype: str) -> bool:
        """Whether ``dtype`` is kept for exactness checks (float64): a draft for such a target
        runs in the same numerics rather than the fastest."""
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {', '.join(self.dtypes)}>"


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Make ``backend`` the one that runs each of its dtypes (a dtype claimed twice is a bug)."""
    for dtype in backend.dtypes:
        other = _BACKENDS.get(dtype)
        if other is not None and other is not backend:
            raise ValueError(f"dtype {dtype!r} is claimed by {other!r} and {backend!r}")
        _BACKENDS[dtype] = backend
    return backend


def dtype_choices() -> list[str]:
    """Every ``--dtype`` value, in registration order."""
    return list(_BACKENDS)


def backend_for(dtype: str) -> Backend:
    """The backend that runs ``dtype``; a ConfigError listing the choices for an unknown one."""
    backend = _BACKENDS.get(dtype)
    if backend is None:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(_BACKENDS)}")
    return backend


def registered_backends() -> list[Backend]:
    """Each registered backend once, in registration order."""
    return list(dict.fromkeys(_BACKENDS.values()))
