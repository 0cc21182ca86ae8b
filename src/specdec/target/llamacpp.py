"""A draft model run by llama.cpp (through ``llama-cpp-python``) straight from its GGUF file.

Why: on a CPU the draft's cost per token decides whether draft-model speculation pays, and
llama.cpp's quantised dot products (int4/int5 weight blocks times int8 activation blocks, one
compiled graph per token) are several times cheaper per weight than torch's low-bit kernels on
an AVX2-only CPU, with no Python between layers. The draft's numerics cannot change the output
(the target verifies every drafted token with its own numerics), so the draft may run in a
different engine at all: only its token ids and, for sampled requests, the distribution ``q``
it drew them from matter, and both come from the same logits here.

:class:`LlamaCppRunner` offers the part of :class:`specdec.target.ModelRunner`'s interface a
drafting chain uses: ``forward(tokens)`` appends to the draft's KV cache and returns the last
token's logits, ``cache`` tracks the token ids with ``rollback``, ``reset``. Trees need 4D
masks and stay with the torch runner.

``llama-cpp-python`` is an optional dependency (the ``llamacpp`` extra; ``scripts/install.sh``
builds it from source for the machine, a few minutes); nothing imports it unless this draft
engine is asked for.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specdec.errors import ConfigError, ModelNotFoundError

INSTALL_HINT = (
    "the llama.cpp draft engine needs llama-cpp-python: install the llamacpp extra (`bash "
    "scripts/install.sh` builds it from source, a few minutes), or drop dtype=gguf to run the "
    "draft in torch"
)
MAX_CONTEXT = 16_384  # KV slots per request: f16 K and V of a 0.5B Qwen2.5 are 12 KiB a token


def available() -> bool:
    """Whether llama-cpp-python is installed (found without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def _lib():  # noqa: ANN202 - the ctypes module
    if not available():
        raise ConfigError(INSTALL_HINT)
    import llama_cpp

    return llama_cpp


class _Cache:
    """The token ids the llama.cpp context holds for sequence 0, with the rollback a chain
    needs (``layout`` mirrors the torch cache's: full attention, no window)."""

    class _Layout:
        window = None

    layout = _Layout()

    def __init__(self, runner: LlamaCppRunner) -> None:
        self._runner = runner
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.rollback(0)

    def rollback(self, length: int) -> None:
        drop = len(self.tokens) - length
        if drop < 0:
            raise ValueError(f"cannot roll back to {length}: cache holds {len(self.tokens)}")
        if drop:
            self._runner._remove_from(length)
            del self.tokens[length:]


class LlamaModel:
    """One GGUF file loaded by llama.cpp; every request's :class:`LlamaCppRunner` shares it."""

    _init_lock = threading.Lock()
    _backend_ready = False

    def __init__(self, gguf: str | Path) -> None:
        lib = _lib()
        path = Path(gguf)
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
        with LlamaModel._init_lock:
            if not LlamaModel._backend_ready:
                _silence(lib)
                lib.llama_backend_init()
                LlamaModel._backend_ready = True
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self._lib = lib
        self.path = path
        self.ptr = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise ModelNotFoundError(f"llama.cpp cannot load {path} (not a GGUF model it knows?)")
        vocab = lib.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.context_length = int(lib.llama_model_n_ctx_train(self.ptr))
        self.n_params = int(lib.llama_model_n_params(self.ptr))

    def __del__(self) -> None:
        ptr = getattr(self, "ptr", None)
        if ptr:
            self.ptr = None
            try:
                self._lib.llama_model_free(ptr)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
                pass


def _silence(lib) -> None:  # noqa: ANN001
    """llama.cpp logs every load to stderr; keep warnings and errors only."""

    @lib.llama_log_callback
    def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == 4:  # GGML_LOG_LEVEL_ERROR: its warnings are about the file, not for users
            import sys

            sys.stderr.write(text.decode("utf-8", "replace"))

    _silence.callback = _log  # type: ignore[attr-defined]  # ctypes must keep it alive
    lib.llama_log_set(_log, ctypes.c_void_p(0))


class LlamaCppRunner:
    """A llama.cpp context over a shared :class:`LlamaModel`: one request's draft KV cache."""

    def __init__(self, model: LlamaModel, threads: int | None = None) -> None:
        lib = model._lib
        self.model = model
        self._lib = lib
        self.threads = int(threads or torch.get_num_threads())
        self.context_length = min(model.context_length or MAX_CONTEXT, MAX_CONTEXT)
        params = lib.llama_context_default_params()
        params.n_ctx = self.context_length
        params.n_batch = 512
        params.n_ubatch = 512
        params.n_seq_max = 1
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise ConfigError(f"llama.cpp cannot create a context for {model.path}")
        self._memory = lib.llama_get_memory(self.ctx)
        self.cache = _Cache(self)
        self.vocab_size = model.vocab_size
        self.device = torch.device("cpu")

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx:  # freed before its model: this runner holds the model alive
            self.ctx = None
            try:
                self._lib.llama_free(ctx)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
                pass

    def sibling(self) -> LlamaCppRunner:
        """Another context (KV cache) over the same weights, for one more concurrent request."""
        return LlamaCppRunner(self.model, self.threads)

    def reset(self) -> None:
        self.cache.reset()

    def _remove_from(self, position: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, 0, position, -1)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Append ``tokens`` to the cache and return the last one's logits, ``[1, V]`` fp32.

        A drafting chain reads only the last token's logits (its catch-up and every drafted
        token), so that is all llama.cpp computes here."""
        del logits_to_keep  # always the last token: see above
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("forward needs at least one token")
        if len(self.cache) + len(tokens) > self.context_length:
            raise ConfigError(
                f"the llama.cpp draft holds {self.context_length} tokens; this request needs "
                f"{len(self.cache) + len(tokens)}"
            )
        lib = self._lib
        for start in range(0, len(tokens), 512):
            part = tokens[start : start + 512]
            array = (lib.llama_token * len(part))(*part)
            status = lib.llama_decode(self.ctx, lib.llama_batch_get_one(array, len(part)))
            if status != 0:
                self._remove_from(len(self.cache))  # what went in before the failure
                raise RuntimeError(f"llama.cpp decode failed (status {status})")
        self.cache.tokens.extend(tokens)
        ptr = lib.llama_get_logits_ith(self.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))
        return torch.from_numpy(logits.copy())[None]
