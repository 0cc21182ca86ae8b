"""The kquant kernel before and after a change, in one process: every block linear of the Qwen
2.5-Coder 1.5B file (Q4_K and Q6_K, not the LM head) through each version's kernel, k rows a
call, the two versions interleaved per round; and, one thread, a Q4_K layer whose weights stay
in cache (as hot_rows.py). The "before" kernel and its weight packing are built from the
sources at git revision REV (under another extension name, so both load at once).

    taskset -c 0,1 .venv/bin/python experiments/kquant/paired_ab.py 6a3806c --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
KS = (1, 2, 3, 4, 5, 8, 16, 64)


def before(rev: str, tmp: Path) -> ModuleType:
    """``specdec.target.kquant`` as of ``rev``, with its own compiled kernel."""
    from torch.utils import cpp_extension

    for name in ("kquant.cpp", "layer.cpp", "kquant.py"):
        src = "src/specdec/target/" + ("csrc/" if name.endswith(".cpp") else "") + name
        text = subprocess.run(
            ["git", "show", f"{rev}:{src}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        (tmp / name).write_text(text)
    (tmp / "build").mkdir()
    ext = cpp_extension.load(
        name="kquant_before",
        sources=[str(tmp / "kquant.cpp"), str(tmp / "layer.cpp")],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp / "build"),
    )
    spec = importlib.util.spec_from_file_location("kquant_before_py", tmp / "kquant.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.extension = lambda: ext  # type: ignore[attr-defined]
    return module


def model_layers(module: ModuleType, gguf: Path, head: bool) -> list:
    """The file's block linears; with ``head``, its LM head too (``output``, or the tied
    ``token_embd``)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf)).tensors
    names = {t.name for t in tensors}
    heads = {"output.weight"} if "output.weight" in names else {"token_embd.weight"}
    return [
        module.KQuantLinear.from_gguf(t.tensor_type.name, np.asarray(t.data), int(t.shape[0]))
        for t in tensors
        if (t.name.startswith("blk.") or (head and t.name in heads))
        and t.tensor_type.name in module.KIND_IDS
    ]


def sweep(versions: dict[str, list], ks: tuple[int, ...], repeats: int) -> dict:
    widths = {layer.in_features for layers in versions.values() for layer in layers}
    out: dict[str, dict[int, list[float]]] = {v: {k: [] for k in ks} for v in versions}
    for _ in range(repeats):
        for k in ks:
            xs = {n: torch.randn(k, n) for n in widths}
            for name, layers in versions.items():
                t0 = time.perf_counter()
                for layer in layers:
                    layer.mm(xs[layer.in_features])
                out[name][k].append(time.perf_counter() - t0)
    return {v: {k: statistics.median(t) for k, t in d.items()} for v, d in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev", help="git revision of the kernel before the change")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--gguf", type=Path, default=None, help="another file (default: the 1.5B's)")
    ap.add_argument("--no-hot", action="store_true", help="skip the in-cache layer")
    ap.add_argument("--head", action="store_true", help="the LM head too")
    args = ap.parse_args()
    from specdec.target import kquant as after
    from specdec.target.packs import pack_gguf
    from tests.test_kquant import random_blocks

    with tempfile.TemporaryDirectory() as tmp:
        old = before(args.rev, Path(tmp))
        gguf = args.gguf or Path(pack_gguf("qwen2.5-coder-1.5b"))
        torch.set_num_threads(args.threads)
        versions = {
            "before": model_layers(old, gguf, args.head),
            "after": model_layers(after, gguf, args.head),
        }
        res = sweep(versions, KS, args.repeats)
        what = "block linears and LM head" if args.head else "block linears"
        print(f"{gguf.name}: {what}, {args.threads} threads, ms per pass of k rows\n")
        print("| k | before | after | before / after | after, ÷ its k = 1 |")
        print("|---:|---:|---:|---:|---:|")
        for k in KS:
            b, a = res["before"][k] * 1e3, res["after"][k] * 1e3
            print(f"| {k} | {b:.2f} | {a:.2f} | {b / a:.3f} | {a / (res['after'][1] * 1e3):.2f} |")
        if args.no_hot:
            return
        torch.set_num_threads(1)
        blocks = random_blocks("Q4_K", 1024, 1536, 0)
        hot = {
            "before": [old.KQuantLinear.from_gguf("Q4_K", blocks, 1536)],
            "after": [after.KQuantLinear.from_gguf("Q4_K", blocks, 1536)],
        }
        rows = (1, 2, 4, 8, 16, 64)
        res = sweep(hot, rows, 400)
        print("\nQ4_K 1024 x 1536 in cache, 1 thread, µs a call\n")
        print("| rows | before | after | before / after |")
        print("|---:|---:|---:|---:|")
        for k in rows:
            b, a = res["before"][k] * 1e6, res["after"][k] * 1e6
            print(f"| {k} | {b:.1f} | {a:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
