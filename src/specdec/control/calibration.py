"""The target's verification cost T(n), measured once on this machine and saved per model.

What a speculator is worth depends on T(n)/T(1), the cost of verifying n tokens relative to one
plain decoding step, and that ratio is a property of the hardware, the numerics and the model
(on a CPU a 16-token chain costs well over one decode step even on the fast fp32 path,
experiments/verification-cost/2026-11-29-numerics.md; on an accelerator it is nearly free).
``specdec calibrate cost`` measures it for chains (the model's causal fast path) and for trees
(4D mask, explicit positions), n = 1 .. 64, over a cache of a typical prompt's length, and
saves it under the specdec cache keyed by model identity, dtype, device and (on a
CPU) thread count. The engine's :class:`~specdec.control.budget.CostModel` then starts from
these ratios instead of a generic slope and keeps refining them online from the steps it times.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdec.tree import DraftTree

if TYPE_CHECKING:
    from specdec.target import LoadedModel

log = logging.getLogger(__name__)

FORMAT = "specdec-cost-calibration"
VERSION = 1
DEFAULT_SIZES = tuple(range(1, 65))
# what the first use of a model times: a grid (the cost model interpolates between sizes), in
# tens of seconds for a 1.5B model in fp32 (experiments/draft-model/2026-12-05-draft-requant.md)
FIRST_USE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
FIRST_USE_ENV = "SPECDEC_CALIBRATE"
FIRST_USE_MODES = ("packs", "always", "never")


@dataclass(frozen=True)
class CostCalibration:
    """Median verification seconds per node count, for chains and trees, and where measured."""

    chain: dict[int, float]
    tree: dict[int, float]
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    prefix_len: int = 200

    def ratios(self, tree: bool = False) -> dict[int, float]:
        """T(n)/T(1), what decisions use (absolute times drift with machine load).

        >>> CostCalibration({1: 0.1, 4: 0.12}, {}).ratios()
        {1: 1.0, 4: 1.2}
        """
        table = self.tree if tree else self.chain
        t1 = self.chain.get(1) or table.get(1)
        if not t1:
            return {}
        return {n: round(s / t1, 6) for n, s in sorted(table.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "prefix_len": self.prefix_len,
            "chain_seconds": {str(n): s for n, s in sorted(self.chain.items())},
            "tree_seconds": {str(n): s for n, s in sorted(self.tree.items())},
            "chain_ratio": {str(n): r for n, r in self.ratios(False).items()},
            "tree_ratio": {str(n): r for n, r in self.ratios(True).items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostCalibration:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} (version {VERSION})")

        def table(key: str) -> dict[int, float]:
            out = {int(n): float(s) for n, s in data[key].items()}
            if any(n < 1 or not s > 0 for n, s in out.items()):
                raise ValueError(f"{key} holds a size < 1 or a non-positive time")
            return out

        return cls(
            chain=table("chain_seconds"),
            tree=table("tree_seconds"),
            device=str(data.get("device", "cpu")),
            dtype=str(data.get("dtype", "float32")),
            threads=int(data.get("threads", 1)),
            prefix_len=int(data.get("prefix_len", 0)),
        )


def _device(loaded: LoadedModel) -> str:
    return str(loaded.device)


def _on_cpu(loaded: LoadedModel) -> bool:
    return _device(loaded).startswith("cpu")


def _kernel_key(loaded: LoadedModel) -> list[str]:
    """For numerics that run specdec's own compiled kernel, a digest of its sources: a new
    kernel changes T(n)/T(1), and a curve measured with the old one would price every draft
    by the old costs after an upgrade."""
    if loaded.dtype_name != "kquant":
        return []
    from specdec.target.kquant import kernel_digest

    return [f"kernel={kernel_digest()}"]


def cost_calibration_path(loaded: LoadedModel) -> Path:
    """Per model identity, dtype, device, the kernel where specdec compiles its own and, on a
    CPU, torch's thread count: each changes T(n)/T(1). Threads matter because one decoding
    step is bound by memory bandwidth, which more threads barely raise, while verifying n
    tokens is bound by arithmetic, which they divide: a curve measured on 2 threads prices
    drafts too cheaply on 1."""
    threads = [f"threads={torch.get_num_threads()}"] if _on_cpu(loaded) else []
    return legacy_cost_calibration_path(loaded, *threads, *_kernel_key(loaded))


def legacy_cost_calibration_path(loaded: LoadedModel, *more: str) -> Path:
    """Keyed by dtype and device only (and ``more``): where calibrations were saved before the
    thread count was part of the key (still read on the CPU: :func:`load_cost_calibration`)."""
    from specdec.target.loading import calibration_file

    return calibration_file(loaded, "cost", loaded.dtype_name, _device(loaded), *more)


def save_cost_calibration(loaded: LoadedModel, calibration: CostCalibration) -> Path:
    """Write atomically (a reader never sees half a file)."""
    path = cost_calibration_path(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    body = {**calibration.to_json(), "target": loaded.identity()}
    tmp.write_text(json.dumps(body, indent=2))
    os.replace(tmp, path)
    return path


def load_cost_calibration(loaded: LoadedModel) -> CostCalibration | None:
    """The saved calibration for ``loaded``, or ``None`` (an unreadable file is ignored with a
    warning: the engine then falls back to its generic prior, which is slower, never wrong)."""
    path = cost_calibration_path(loaded)
    # files from before the thread count was in the key (never for a compiled kernel's
    # numerics: those files predate its digest too)
    legacy = not path.is_file() and _on_cpu(loaded) and not _kernel_key(loaded)
    if legacy:
        path = legacy_cost_calibration_path(loaded)
    if not path.is_file():
        return None
    try:
        calibration = CostCalibration.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        log.warning("ignoring unreadable cost calibration %s (%s); rerun it", path, e)
        return None
    if legacy and calibration.threads != torch.get_num_threads():
        return None  # measured on another thread count: not this machine's curve
    return calibration


def _probe_tree(root: int, n: int, vocab: int) -> DraftTree:
    """An n-node tree of Medusa/EAGLE shape (the sparse-64 preset: wide near the root)."""
    from specdec.tree.topology import load_topology, tree_from_topology

    topology = load_topology("sparse-64", 4)
    ranked = [[(100 + 10 * d + r) % vocab for r in range(10)] for d in range(4)]
    return tree_from_topology(root, topology, ranked, budget=n - 1)


def measure_verify_costs(
    loaded: LoadedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    *,
    repeats: int = 5,
    prefix_len: int = 200,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> CostCalibration:
    """Time one verification pass of every size, as a chain and as a tree, over a
    ``prefix_len``-token cache; the median of ``repeats`` passes each. Sizes are interleaved
    within each repeat so that a burst of load on a shared machine spreads over all of them
    instead of skewing one. ``progress`` wraps the iterable of passes (tqdm)."""
    if not sizes or min(sizes) < 1 or max(sizes) > 64:
        raise ValueError("sizes must lie in 1..64")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    # the verifier's own passes: torch's ModelRunner, or llama.cpp's for dtype gguf
    runner, verify = loaded.backend.verification_runner(loaded, threads=torch.get_num_threads())
    vocab = runner.vocab_size
    prefix_len = max(1, min(prefix_len, runner.context_length - max(sizes) - 1))
    prefix = [(1000 + i) % vocab for i in range(prefix_len)]
    ns = sorted(set(sizes) | {1})  # ratios are relative to T(1)
    shapes = [(n, tree) for n in ns for tree in (False, True) if n > 1 or not tree]
    probes = {
        (n, tree): (
            _probe_tree(7, n, vocab) if tree else DraftTree.chain(7, list(range(20, 19 + n)))
        )
        for n, tree in shapes
    }
    times: dict[tuple[int, bool], list[float]] = {s: [] for s in shapes}
    runner.forward(prefix, logits_to_keep=1)
    plan = [(r, s) for r in range(repeats + 1) for s in shapes]  # repeat 0 warms up
    for r, shape in progress(plan) if progress else plan:
        t0 = time.perf_counter()
        verify(probes[shape])
        elapsed = time.perf_counter() - t0
        runner.cache.rollback(prefix_len)
        if r > 0:
            times[shape].append(elapsed)
    chain = {n: statistics.median(times[(n, False)]) for n, tree in shapes if not tree}
    trees = {n: statistics.median(times[(n, True)]) for n, tree in shapes if tree}
    trees[1] = chain[1]  # a one-node tree is the root alone: the same pass
    return CostCalibration(
        chain=chain,
        tree=dict(sorted(trees.items())),
        device=_device(loaded),
        dtype=loaded.dtype_name,
        threads=torch.get_num_threads(),
        prefix_len=prefix_len,
    )


def _first_use_mode() -> str:
    mode = os.environ.get(FIRST_USE_ENV, "packs").strip().lower() or "packs"
    if mode not in FIRST_USE_MODES:
        log.warning(
            "%s=%r is not one of %s; using 'packs'", FIRST_USE_ENV, mode, ", ".join(FIRST_USE_MODES)
        )
        return "packs"
    return mode


def _from_pack(loaded: LoadedModel) -> bool:
    from specdec.target.packs import PACKS

    return Path(loaded.source).name in {pack.filename for pack in PACKS.values()}


def calibrate_on_first_use(loaded: LoadedModel) -> CostCalibration | None:
    """The saved calibration, or for a model that should have one, a new one measured now.

    Why: the draft length a controller picks is only as good as its price of verification,
    and a generic prior misprices real models badly (the 1.5B Qwen in fp32 can verify 4 tokens
    *faster* than 1, and the paired draft was much faster on code with the calibration than
    with the prior: experiments/draft-model/2026-12-05-qwen-pair-epyc2.md). A user should not
    need to know ``specdec calibrate cost`` exists, so the first engine built on a model pack
    times a grid of sizes (seconds, once per machine, model, dtype and device) and saves it.
    ``SPECDEC_CALIBRATE`` chooses where: ``packs`` (the default), ``always`` (any model) or
    ``never``. A failure only costs speed: it is logged and the generic prior is used.
    """
    saved = load_cost_calibration(loaded)
    mode = _first_use_mode()
    if saved is not None or mode == "never" or (mode == "packs" and not _from_pack(loaded)):
        return saved
    from tqdm.auto import tqdm

    path = cost_calibration_path(loaded)
    log.warning(
        "measuring this model's verification cost once on this machine (saved to %s; "
        "%s=never skips it)",
        path,
        FIRST_USE_ENV,
    )

    def progress(plan: Iterable[Any]) -> Iterable[Any]:
        return tqdm(plan, desc="calibrating verification cost", unit="pass", leave=False)

    try:
        calibration = measure_verify_costs(loaded, FIRST_USE_SIZES, repeats=2, progress=progress)
        save_cost_calibration(loaded, calibration)
    except (OSError, RuntimeError, ValueError) as e:
        log.warning("could not calibrate the verification cost (%s); using the generic prior", e)
        return None
    return calibration
