"""The llama.cpp backend (``--dtype gguf``): the target verified by llama.cpp from its GGUF file
(:class:`specdec.target.llamacpp.LlamaCppTarget`), on the CPU, with its own thread count.

What it cannot do, which the capabilities say: no batch scheduler (that needs the torch module),
no hidden states (EAGLE, Medusa), and a llama.cpp draft drafts chains only (trees need 4D masks
over the draft's cache; a llama.cpp verifier takes trees branch by branch).

Drafts run here too (``draft:...,dtype=gguf`` or ``gguf-q4_0``: :mod:`specdec.target.drafts`);
their dtype names are parsed by :func:`parse_draft_dtype`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdec.errors import ConfigError, CorruptModelError
from specdec.request import read_chat_template
from specdec.target import llamacpp
from specdec.target.backends.dense import load_torch
from specdec.target.base import Backend, LoadedModel, ModelSource, Target
from specdec.target.checkpoints import convert_gguf, load_tokenizer, resolve_gguf
from specdec.target.runner import TokenRunner
from specdec.tree import DraftTree

GGUF = "gguf"  # the GGUF's own quantised weights, run by llama.cpp
# a draft's GGUF requantized once by llama.cpp: gguf-KIND, KIND in llamacpp.REQUANT_TYPES
REQUANTIZED_PREFIX = GGUF + "-"
# a draft's default on a CPU (the fastest measured): its GGUF requantized to Q4_0
DEFAULT_DRAFT_DTYPE = REQUANTIZED_PREFIX + "q4_0"


def parse_draft_dtype(dtype: str | None) -> tuple[bool, str | None]:
    """Whether a draft's ``dtype`` runs it in llama.cpp, and the requantization it asks for.

    >>> parse_draft_dtype("gguf"), parse_draft_dtype("gguf-q4_0"), parse_draft_dtype("bfloat16")
    ((True, None), (True, 'q4_0'), (False, None))
    """
    if dtype == GGUF:
        return True, None
    if dtype is not None and dtype.startswith(REQUANTIZED_PREFIX):
        return True, dtype[len(REQUANTIZED_PREFIX) :]
    return False, None


class LlamaCppLoadedModel(LoadedModel):
    """A model loaded for ``dtype="gguf"`` (:class:`LlamaCppBackend`): llama.cpp verifies from
    the GGUF file, and the torch model exists only if something asks for its weights.

    Why lazily: the tokenizer, config, identity (which keys trained speculators and cost
    calibrations) and the weight bytes all come from the converted directory's files without
    loading a tensor, so a request served through llama.cpp holds the GGUF's bytes only, not
    also a float32 copy over five times larger (4 bytes a weight against the 4- to 6-bit
    blocks of a Q4_K_M file). The float32 copy (stock linears) loads on first use of
    :attr:`model`: a speculator that drafts from the target's own layers (``draft:layers:N``,
    ``self``), training, export.
    """

    def __init__(
        self,
        directory: Path,
        tokenizer: PreTrainedTokenizerBase,
        source: str,
        loader: Callable[[], PreTrainedModel],
        backend: LlamaCppBackend,
    ) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.numerics = "llama.cpp: the GGUF's own quantised blocks (llama-cpp-python), CPU"
        self.dtype_name = backend.dtypes[0]
        self.backend = backend
        self.directory = directory
        self._loader = loader
        self._model: PreTrainedModel | None = None
        self._meta: PreTrainedModel | None = None
        try:
            self._config = AutoConfig.from_pretrained(str(directory))
            self._generation_config = GenerationConfig.from_pretrained(str(directory))
        except Exception as e:
            raise CorruptModelError(f"cannot read the model files in {directory}: {e}") from e

    def __repr__(self) -> str:
        return f"LlamaCppLoadedModel(source={self.source!r}, materialised={self.materialised})"

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property  # type: ignore[override]
    def model(self) -> PreTrainedModel:
        if self._model is None:
            self._model = self._loader()
        return self._model

    @model.setter
    def model(self, value: PreTrainedModel) -> None:
        self._model = value

    @model.deleter
    def model(self) -> None:
        self._model = None

    @property
    def materialised(self) -> bool:
        """Whether the float32 torch copy has been loaded."""
        return self._model is not None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def config(self) -> Any:
        return self._config

    @property
    def generation_config(self) -> Any:
        return self._generation_config

    def weight_bytes(self) -> int:
        """What llama.cpp reads per token: the GGUF file's quantised blocks."""
        return Path(self.source).stat().st_size

    def _skeleton(self) -> PreTrainedModel:
        """The model's modules on the meta device: names and shapes, no memory (built once:
        every draft speculator built for this target asks for its parameter count)."""
        if self._meta is None:
            with torch.device("meta"):
                self._meta = AutoModelForCausalLM.from_config(self._config)
        return self._meta

    def _class_name(self) -> str:
        return type(self._skeleton()).__name__

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self._skeleton().parameters())

    def _embedding_digest(self) -> str:
        """The digest, computed once per converted file and kept beside it: reading the
        float32 embedding maps its pages (151,936 x 1,536 floats for the 1.5B Qwen, close to a
        gigabyte), which would count in the process's resident memory on every start."""
        saved = self.directory / "specdec_embedding_sha256.txt"
        if saved.is_file():
            return saved.read_text().strip()
        digest = self.compute_embedding_digest()
        tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(digest + "\n")
            tmp.replace(saved)
        except OSError:  # a read-only cache: compute it next time too
            tmp.unlink(missing_ok=True)
        return digest

    def compute_embedding_digest(self) -> str:
        """:meth:`LoadedModel.identity`'s digest read from the safetensors file in slices of
        rows (no full copy), equal to the torch model's (tested): the file holds the input
        embedding itself, or, for tied embeddings, only the output layer it shares."""
        from safetensors import safe_open

        skeleton = self._skeleton()
        embedding = skeleton.get_input_embeddings().weight
        names = [
            name for name, p in skeleton.named_parameters(remove_duplicate=False) if p is embedding
        ]
        h = hashlib.sha256()
        with safe_open(str(self.directory / "model.safetensors"), "pt") as f:
            name = next((n for n in names if n in set(f.keys())), None)
            if name is None:
                raise CorruptModelError(f"{self.directory} holds no embedding ({names})")
            rows = f.get_slice(name)
            total = int(rows.get_shape()[0])
            for start in range(0, total, 8192):
                part = rows[start : min(total, start + 8192)]
                bits = part.to(torch.bfloat16).contiguous().view(torch.int16)
                h.update(bits.numpy().tobytes())
        return h.hexdigest()


class LlamaCppBackend(Backend):
    """llama.cpp over the GGUF file itself; the torch model beside it loads only when asked
    for (:class:`LlamaCppLoadedModel`)."""

    name: ClassVar[str] = "llama.cpp"
    dtypes: ClassVar[tuple[str, ...]] = (GGUF,)
    batching: ClassVar[bool] = False
    trees: ClassVar[bool] = False
    features: ClassVar[bool] = False
    threads: ClassVar[bool] = True

    def load(self, dtype: str, source: ModelSource) -> LoadedModel:
        device = source.device
        if str(device) not in ("cpu", "auto"):
            raise ConfigError(
                f"dtype gguf runs the target in llama.cpp on the CPU, not on {device}; use "
                "--device cpu, or another --dtype on the GPU"
            )
        if not llamacpp.available():
            raise ConfigError(
                "dtype gguf runs the target in llama.cpp and needs llama-cpp-python: install the "
                "llamacpp extra (`bash scripts/install.sh` builds it), or use another --dtype"
            )
        gguf_path, model = resolve_gguf(source.model, source.gguf, source.cache_dir)
        if gguf_path is None:
            raise ConfigError(
                f"dtype gguf runs a GGUF file in llama.cpp, and {str(model)!r} is a model "
                "directory; pass --gguf FILE or a model pack alias, or use another --dtype"
            )
        # once per file: config, tokenizer, identity
        directory = convert_gguf(gguf_path, source.cache_dir)
        tokenizer = load_tokenizer(directory)
        if source.chat_template is not None:
            tokenizer.chat_template = read_chat_template(source.chat_template)
        stock = ModelSource(
            gguf=gguf_path, cache_dir=source.cache_dir, chat_template=source.chat_template
        )

        def torch_copy() -> PreTrainedModel:
            return load_torch("float32-stock", stock).model

        return LlamaCppLoadedModel(directory, tokenizer, str(gguf_path), torch_copy, self)

    def verifier(self, loaded: LoadedModel, threads: int | None = None) -> Target:
        return llamacpp.LlamaCppTarget(loaded.source, threads=threads)

    def verification_runner(
        self, loaded: LoadedModel, threads: int | None = None
    ) -> tuple[TokenRunner, Callable[[DraftTree], torch.Tensor]]:
        target = llamacpp.LlamaCppTarget(loaded.source, threads=threads)
        return target.runner, target.verify
