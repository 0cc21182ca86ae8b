"""A/B of a ``--dtype kquant`` decode step outside the matmul kernel (issue 24).

Loads the Qwen2.5-Coder-1.5B Q4_K_M once and times, interleaved in one process, a k-row pass
over a cache of ``--context`` tokens (then rolled back) in three modes:

- ``before``: Hugging Face's modules over the concatenating ``DynamicLayer`` cache (as before
  the change);
- ``cache``: HF's modules over the in-place :class:`specdec.cache.buffer.BufferLayer` cache;
- ``after``: the lean kquant modules (:mod:`specdec.target.kquant_layers`) over that cache.

``rest`` rows stub the kernel (an empty result of the right shape, what the old
``/tmp/prof_rest.py`` did), so they time everything but the linears; ``model`` rows run it.
Run pinned to one core with one thread::

    taskset -c 0 .venv/bin/python experiments/kquant/kquant_rest.py --threads 1 --ks 1,8 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer

import specdec.target.kquant as kq
from specdec.target import ModelRunner, load_model, lowbit
from specdec.target.kquant_layers import use_lean_layers

MODES = ("before", "cache", "after")


class _Stub:
    """The extension with the matmul replaced by an empty result (the other calls kept)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def kquant_mm(self, x, codes, meta, d, dmin, q6, portable):  # noqa: ANN001, ANN201
        return torch.zeros(x.shape[0], d.shape[0])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ks", default="1,8")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10, help="passes per timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", choices=MODES, help="also print an operator profile (stubbed)")
    ap.add_argument(
        "--quality",
        action="store_true",
        help="also decode bench/lowbit.py's fixed text in 8-token passes (the row-wise path, "
        "not prefill) in modes before and after: perplexity and argmax agreement",
    )
    ap.add_argument("--out", help="write the medians as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    # load with HF's modules, then build the lean ones on the same (shared) weights
    scheme = lowbit.SCHEMES["kquant"]
    lowbit.SCHEMES["kquant"] = dataclasses.replace(scheme, after_swap=lambda m: None)
    loaded = load_model(args.model, dtype="kquant")
    lowbit.SCHEMES["kquant"] = scheme
    model = loaded.model
    layers = model.model.layers
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    hf = [[getattr(layer, n) for n in names] for layer in layers] + [model.model.norm]
    hf_class = type(layers[0])
    if not use_lean_layers(model):
        raise SystemExit("the lean modules do not apply to this model")
    lean = [[getattr(layer, n) for n in names] for layer in layers] + [model.model.norm]
    lean_class = type(layers[0])
    real = kq.extension()
    stub = _Stub(real)
    runner = ModelRunner(model)

    def set_mode(mode: str) -> None:
        mods = lean if mode == "after" else hf
        for layer, mine in zip(layers, mods, strict=False):
            layer.__class__ = lean_class if mode == "after" else hf_class
            for n, m in zip(names, mine, strict=True):
                setattr(layer, n, m)
        model.model.norm = mods[-1]
        prompt = list(range(100, 100 + args.context))
        runner.reset()
        if mode == "before":  # transformers' own concatenating layers
            runner.cache.hf.layers = [
                DummyLayer() if isinstance(layer, DummyLayer) else DynamicLayer()
                for layer in runner.cache.hf.layers
            ]
            assert isinstance(runner.cache.hf, Cache)
        runner.forward(prompt)

    def step(k: int) -> None:
        n = len(runner.cache)
        runner.forward(list(range(500, 500 + k)))
        runner.cache.rollback(n)

    ks = [int(k) for k in args.ks.split(",")]
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for stubbed in (True, False):
            kq.extension = (lambda: stub) if stubbed else (lambda: real)
            for k in ks:
                for mode in MODES:
                    set_mode(mode)
                    for _ in range(2):
                        step(k)
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        step(k)
                    ms = (time.perf_counter() - t0) / args.steps * 1e3
                    key = f"{'rest' if stubbed else 'model'} k={k} {mode}"
                    times.setdefault(key, []).append(ms)
    kq.extension = lambda: real
    medians = {key: statistics.median(v) for key, v in times.items()}
    print(f"{'pass':<16}" + "".join(f"{m:>16}" for m in MODES))
    for what in ("rest", "model"):
        for k in ks:
            base = medians[f"{what} k={k} before"]
            cells = [
                f"{medians[f'{what} k={k} {m}']:8.2f} ({medians[f'{what} k={k} {m}'] / base:.2f})"
                for m in MODES
            ]
            print(f"{what + f' k={k}':<16}" + "".join(f"{c:>16}" for c in cells))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        kq.extension = lambda: stub
        set_mode(args.profile)
        for _ in range(3):
            step(1)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(10):
                step(1)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        kq.extension = lambda: real
    quality = {}
    if args.quality:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
        from lowbit import fixed_text  # bench/lowbit.py

        ids = loaded.tokenizer(fixed_text())["input_ids"]
        argmax = {}
        for mode in ("before", "after"):
            set_mode(mode)
            runner.reset()
            logits = torch.cat([runner.forward(ids[i : i + 8]) for i in range(0, len(ids), 8)])
            logp = torch.log_softmax(logits[:-1].double(), -1)
            nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
            argmax[mode] = logits.argmax(-1)
            quality[f"perplexity {mode}"] = float(torch.exp(nll))
        quality["argmax agreement"] = float((argmax["before"] == argmax["after"]).float().mean())
        quality["tokens"] = len(ids)
        print(quality)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "median_ms": medians, "runs_ms": times, "quality": quality},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
