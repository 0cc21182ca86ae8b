"""Models run by llama.cpp (through ``llama-cpp-python``) straight from their GGUF files: a
draft (``draft:MODEL,dtype=gguf``) and the target (``--dtype gguf``, :class:`LlamaCppTarget`
at the end of this module).

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
import hashlib
import importlib.util
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from specdec.errors import ConfigError, ModelNotFoundError
from specdec.target import files
from specdec.tree import DraftTree

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "the llama.cpp draft engine needs llama-cpp-python: install the llamacpp extra (`bash "
    "scripts/install.sh` builds it from source, a few minutes), or drop dtype=gguf to run the "
    "draft in torch"
)
MAX_CONTEXT = 16_384  # KV slots per request: f16 K and V of a 0.5B Qwen2.5 are 12 KiB a token
INITIAL_CONTEXT = 4096  # slots allocated at first (llama.cpp's default); grown on demand
PASS = 512  # tokens per llama_decode call (the context's n_batch and n_ubatch)


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
        # a weak reference: a strong one made runner and cache a cycle, so a finished
        # request's context (tens of MB of KV cache) lived until the cyclic garbage collector
        # ran, and a busy server's memory grew by gigabytes between collections
        self._runner = weakref.proxy(runner)
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


_BACKEND_LOCK = threading.Lock()
_backend_ready = False


def _backend(lib) -> None:  # noqa: ANN001 - the ctypes module
    """llama.cpp's backend, initialised (and its log silenced) once per process."""
    global _backend_ready
    with _BACKEND_LOCK:
        if not _backend_ready:
            _silence(lib)
            lib.llama_backend_init()
            _backend_ready = True


def has_amx(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later), from /proc/cpuinfo.

    Why it matters: llama.cpp built for such a CPU repacks weights into its AMX buffer type,
    and its first decode there crashed the process (segmentation fault in ``llama_decode``,
    llama-cpp-python 0.3.36; upstream ggml-org/llama.cpp#20824, closed without a fix; the same
    crash in a llama.cpp build: experiments/llamacpp/2026-12-01-lowbit.md). :class:`LlamaModel`
    then loads without extra buffer types: no repacking, the plain CPU kernels.

    >>> has_amx("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8")
    True
    >>> has_amx("flags\t\t: fpu avx2 avx512f avx512_vnni")
    False
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no AMX build to avoid there either
            return False
    return any(
        line.startswith("flags") and "amx_tile" in line.split() for line in cpuinfo.splitlines()
    )


class LlamaModel:
    """One GGUF file loaded by llama.cpp; every request's :class:`LlamaCppRunner` shares it."""

    def __init__(self, gguf: str | Path) -> None:
        lib = _lib()
        path = Path(gguf)
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
        _backend(lib)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        if has_amx() and hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False  # llama.cpp's AMX buffers crash its decode (has_amx)
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
        self.model = model
        self._lib = model._lib
        self.threads = int(threads or torch.get_num_threads())
        # what a request may use; the KV cache itself starts smaller and grows (_grow)
        self.context_length = min(model.context_length or MAX_CONTEXT, MAX_CONTEXT)
        self.allocated = min(self.context_length, INITIAL_CONTEXT)
        self.ctx = self._new_context(self.allocated)
        self._batch = self._new_batch()
        self.cache = _Cache(self)
        self.vocab_size = model.vocab_size
        self.device = torch.device("cpu")

    def _new_context(self, n_ctx: int):  # noqa: ANN202 - a ctypes pointer
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = PASS
        params.n_ubatch = PASS
        params.n_seq_max = 1
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.no_perf = True
        ctx = lib.llama_init_from_model(self.model.ptr, params)
        if not ctx:
            raise ConfigError(f"llama.cpp cannot create a context for {self.model.path}")
        self._memory = lib.llama_get_memory(ctx)
        return ctx

    def _grow(self, needed: int) -> None:
        """A larger KV cache, holding what the old one held.

        Why: llama.cpp allocates (and zeroes) a context's whole KV cache up front, 28 KiB a
        token for the 1.5B Qwen, so every request's context starts at INITIAL_CONTEXT slots
        (llama.cpp's own default) and doubles when a request outgrows it. The held tokens are
        decoded again into the new cache; their K/V may differ in the last bits from the
        passes that first computed them (llama.cpp's results depend on a pass's shape), which
        is the rounding ``--dtype gguf`` already has between k-token and 1-token passes."""
        size = min(self.context_length, max(needed, 2 * self.allocated))
        held = list(self.cache.tokens)
        old = self.ctx
        self.ctx = self._new_context(size)
        self.allocated = size
        self._lib.llama_free(old)
        self.cache.tokens = []
        if held:
            self._decode_last(held)

    def _new_batch(self):  # noqa: ANN202 - a ctypes struct
        """One batch of PASS slots for every verification pass, every row's logits asked for.

        Why: allocating and filling a batch per pass from Python cost a measurable share of a
        decode step (experiments/llamacpp/2026-12-04-llamacpp-plain-gap.md); only tokens and
        positions change between passes, and they are written through numpy views."""
        lib = self._lib
        batch = lib.llama_batch_init(PASS, 0, 1)
        for i in range(PASS):
            batch.n_seq_id[i], batch.logits[i] = 1, 1
            batch.seq_id[i][0] = 0
        self._batch_tokens = np.ctypeslib.as_array(batch.token, shape=(PASS,))
        self._batch_pos = np.ctypeslib.as_array(batch.pos, shape=(PASS,))
        return batch

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx:  # freed before its model: this runner holds the model alive
            self.ctx = None
            try:
                self._lib.llama_free(ctx)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
                pass
        batch = getattr(self, "_batch", None)
        if batch is not None:
            self._batch = None
            try:
                self._lib.llama_batch_free(batch)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
                pass

    def sibling(self) -> LlamaCppRunner:
        """Another context (KV cache) over the same weights, for one more concurrent request."""
        return LlamaCppRunner(self.model, self.threads)

    def reset(self) -> None:
        self.cache.reset()

    def _remove_from(self, position: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, 0, position, -1)

    def _room_for(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` as ints, refused when empty or past the context."""
        ids = [int(t) for t in tokens]
        if not ids:
            raise ValueError("forward needs at least one token")
        needed = len(self.cache) + len(ids)
        if needed > self.context_length:
            raise ConfigError(
                f"the llama.cpp context holds {self.context_length} tokens; this request needs "
                f"{needed}"
            )
        if needed > self.allocated:
            self._grow(needed)
        return ids

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Append ``tokens`` to the cache and return the last one's logits, ``[1, V]`` fp32.

        A drafting chain reads only the last token's logits (its catch-up and every drafted
        token), so that is all llama.cpp computes here."""
        del logits_to_keep  # always the last token: see above
        self._decode_last(self._room_for(tokens))
        ptr = self._lib.llama_get_logits_ith(self.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))
        return torch.from_numpy(logits.copy())[None]

    def _decode_last(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the cache in passes of PASS, computing the last one's logits."""
        lib = self._lib
        for start in range(0, len(tokens), PASS):
            part = tokens[start : start + PASS]
            array = (lib.llama_token * len(part))(*part)
            status = lib.llama_decode(self.ctx, lib.llama_batch_get_one(array, len(part)))
            if status != 0:
                self._remove_from(len(self.cache))  # what went in before the failure
                raise RuntimeError(f"llama.cpp decode failed (status {status})")
        self.cache.tokens.extend(tokens)

    @torch.inference_mode()
    def forward_all(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` and return every one's logits, ``[T, V]`` fp32 (verification)."""
        tokens = self._room_for(tokens)
        lib = self._lib
        batch = self._batch
        parts = []
        for start in range(0, len(tokens), PASS):
            part = tokens[start : start + PASS]
            base = len(self.cache)
            n = len(part)
            self._batch_tokens[:n] = part
            self._batch_pos[:n] = np.arange(base, base + n)
            batch.n_tokens = n
            status = lib.llama_decode(self.ctx, batch)
            if status != 0:
                self._remove_from(base)
                raise RuntimeError(f"llama.cpp decode failed (status {status})")
            self.cache.tokens.extend(part)
            # every row was asked for, so llama.cpp's output buffer holds them in batch order
            rows = np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(n, self.vocab_size))
            parts.append(torch.from_numpy(rows.copy()))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# what ``draft:...,dtype=gguf-KIND`` requantizes a draft to: (llama_ftype of the file,
# ggml_type of its output head)
REQUANT_TYPES = {"q4_0": (2, 2)}
_REQUANT_LOCK = threading.Lock()


def requantized(gguf: str | Path, kind: str = "q4_0", cache_dir: Path | None = None) -> Path:
    """``gguf`` requantized by llama.cpp to ``kind`` (every matrix, the output head included),
    once, into the specdec cache.

    Why: a draft's numerics cannot change the output (the target verifies every drafted
    token), only how often a draft is accepted, so the draft may run in whichever weights are
    fastest. The Qwen2.5-Coder-0.5B Q4_K_M file holds a Q8_0 output head (a large share of the
    bytes a token reads) and Q5_0 layers, which llama.cpp multiplies with its generic dot
    products on an AVX2 CPU; requantized to Q4_0 (in seconds) every matrix takes its repacked
    8x8 kernels, and the draft decodes much faster with the pair's acceptance unchanged
    (experiments/draft-model/2026-12-05-draft-requant.md). The cached file is keyed by the
    source's path, size and modification time, and written under a temporary name first, so
    an interrupted run never leaves a file that looks whole.
    """
    import json
    import os

    if kind not in REQUANT_TYPES:
        raise ConfigError(
            f"no requantization {kind!r} for a llama.cpp draft; choose one of "
            + ", ".join(sorted(REQUANT_TYPES))
        )
    src = Path(gguf).resolve()
    if not src.is_file():
        raise ModelNotFoundError(f"GGUF file {str(src)!r} does not exist")
    stat = src.stat()
    stamp = {"source": str(src), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "kind": kind}
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    out = (cache_dir or files.cache_root()) / "requant" / f"{src.stem}.{kind}.{key}.gguf"
    with _REQUANT_LOCK:
        if out.is_file():
            return out
        lib = _lib()
        _backend(lib)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot write the requantized draft to {out.parent} ({e}); make it writable "
                "(XDG_CACHE_HOME moves it) or use dtype=gguf to run the file as it is"
            ) from e
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        params = lib.llama_model_quantize_default_params()
        params.ftype, params.output_tensor_type = REQUANT_TYPES[kind]
        params.allow_requantize = True
        params.nthread = max(1, torch.get_num_threads())
        log.warning(
            "requantizing the draft %s to %s once (seconds; cached in %s)",
            src.name,
            kind,
            out.parent,
        )
        try:
            status = lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
            if status != 0 or not tmp.is_file():
                raise ConfigError(
                    f"llama.cpp could not requantize {src} to {kind} (status {status}); "
                    "use dtype=gguf to run the file as it is"
                )
            os.replace(tmp, out)
        except OSError as e:
            raise ConfigError(
                f"cannot write the requantized draft to {out.parent} ({e}); free space there "
                "(XDG_CACHE_HOME moves it) or use dtype=gguf to run the file as it is"
            ) from e
        finally:
            tmp.unlink(missing_ok=True)
    return out


_MODELS: dict[Path, LlamaModel] = {}
_MODELS_LOCK = threading.Lock()


def shared_model(gguf: str | Path) -> LlamaModel:
    """The :class:`LlamaModel` for a GGUF file, loaded once per process."""
    path = Path(gguf).resolve()
    with _MODELS_LOCK:
        if path not in _MODELS:
            _MODELS[path] = LlamaModel(path)
        return _MODELS[path]


@dataclass(frozen=True)
class PlainRun:
    """llama.cpp's own plain greedy decoding of a prompt (:func:`plain_greedy`)."""

    token_ids: list[int]
    seconds: float  # from the prompt's decode to the last token, as specdec's request time

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def plain_greedy(
    gguf: str | Path,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop: frozenset[int] = frozenset(),
    threads: int | None = None,
) -> PlainRun:
    """Decode ``prompt`` as llama.cpp itself does without speculation: the prompt in one
    decode, then one token per ``llama_decode``, each picked by llama.cpp's greedy sampler, in
    a context allocated for the whole request before the clock starts.

    Why here: a user's alternative to specdec is running the same file in llama.cpp, so
    ``--compare`` and the benchmark time it beside ours in one process, on the same threads,
    rather than quote a figure measured elsewhere."""
    runner = LlamaCppRunner(shared_model(gguf), threads)
    lib = runner._lib
    # grows the cache to the whole request now (or refuses it), so no pass reallocates it
    runner._room_for([*prompt, *([0] * max(0, max_new_tokens - 1))])
    sampler = lib.llama_sampler_init_greedy()
    tokens: list[int] = []
    try:
        start = time.perf_counter()
        runner._decode_last([int(t) for t in prompt])
        while True:
            token = int(lib.llama_sampler_sample(sampler, runner.ctx, -1))
            if token in stop:  # ends the output, as in specdec's, without being part of it
                break
            tokens.append(token)
            if len(tokens) >= max_new_tokens:
                break
            runner._decode_last([token])
        seconds = time.perf_counter() - start
    finally:
        lib.llama_sampler_free(sampler)
    return PlainRun(tokens, seconds)


class LlamaCppTarget:
    """The target verified by llama.cpp from its GGUF file (``--dtype gguf``).

    Why: on a CPU, llama.cpp's kernels run the GGUF's own quantised blocks with no second
    rounding and no Python between layers: the 1.5B Qwen decodes faster there than with our
    best torch numerics (docs/lowbit.md, every choice side by side). Lossless means,
    as everywhere, with respect to the numerics run: llama.cpp's logits for a k-token pass may
    differ in the last bits from k one-token passes (llama.cpp picks other kernels for other
    batch sizes), so a near-tie can decide differently in speculative and plain decoding.

    A chain is verified in one pass. A tree is verified branch by branch (each node decoded
    once, rolling back to the branch point): correct for any speculator, and priced as trees
    by the cost model, which then keeps them small. No hidden states: feature speculators
    (EAGLE, Medusa) need a torch target. The cache invariant is :class:`HFTarget`'s: between
    steps the context holds every committed token but the last.
    """

    provides_features: ClassVar[bool] = False

    def __init__(self, gguf: str | Path, threads: int | None = None) -> None:
        self.runner = LlamaCppRunner(shared_model(gguf), threads)
        self._start = 0
        self._tokens: tuple[int, ...] = ()
        self._cached: list[int] = []  # tree nodes after ``_start`` in the context, in order

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def sibling(self) -> LlamaCppTarget:
        """Another context over the same weights (one more concurrent request)."""
        other = LlamaCppTarget.__new__(LlamaCppTarget)
        other.runner = self.runner.sibling()
        other._start, other._tokens, other._cached = 0, (), []
        return other

    def begin(self, prompt: Sequence[int]) -> None:
        self.runner.reset()
        if len(prompt) > 1:
            self.runner.forward(prompt[:-1])

    def verify(self, tree: DraftTree) -> torch.Tensor:
        self._start = len(self.runner.cache)
        self._tokens = tree.tokens
        if tree.is_chain:
            self._cached = list(range(len(tree)))
            return self.runner.forward_all(tree.tokens)  # [N, V]
        children: list[list[int]] = [[] for _ in tree.tokens]
        for node, parent in enumerate(tree.parents[1:], start=1):
            children[parent].append(node)
        logits: list[torch.Tensor | None] = [None] * len(tree)
        self._cached = []
        stack = [[0]]
        while stack:  # depth-first, one leaf's branch at a time
            branch = stack.pop()
            tip = branch[-1]
            if children[tip]:
                stack.extend(branch + [c] for c in reversed(children[tip]))
                continue
            keep = 0
            while keep < min(len(branch), len(self._cached)) and branch[keep] == self._cached[keep]:
                keep += 1
            self.runner.cache.rollback(self._start + keep)
            fresh = branch[keep:]
            rows = self.runner.forward_all([tree.tokens[i] for i in fresh])
            for i, node in enumerate(fresh):
                logits[node] = rows[i]
            self._cached = list(branch)
        return torch.stack([row for row in logits if row is not None])  # [N, V]

    def commit(self, path: Sequence[int]) -> None:
        path = list(path)
        if path == self._cached[: len(path)]:
            self.runner.cache.rollback(self._start + len(path))
            return
        keep = 0
        while keep < min(len(path), len(self._cached)) and path[keep] == self._cached[keep]:
            keep += 1
        self.runner.cache.rollback(self._start + keep)
        self.runner.forward([self._tokens[i] for i in path[keep:]])

    def enable_features(self, layers: Sequence[int] = (-1,)) -> None:
        raise ConfigError(
            "the llama.cpp target (--dtype gguf) has no hidden states for EAGLE or Medusa; "
            "use a torch dtype (e.g. float32) for them"
        )

    @property
    def features(self) -> torch.Tensor | None:
        return None
