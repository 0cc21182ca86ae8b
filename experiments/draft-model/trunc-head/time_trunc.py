"""Times llama.cpp single-token decodes (2 threads, 200-token context) of the full and the
truncated-head draft files, alternated four times; prints ms per token.

    python time_trunc.py FULL.gguf TRUNC.gguf
"""

import sys
import time

import numpy as np
from llama_cpp import Llama


def main() -> None:
    files = {"full": sys.argv[1], "trunc": sys.argv[2]}
    models = {
        k: Llama(model_path=v, n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
        for k, v in files.items()
    }
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, 20000, 200)]
    res: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(4):
        for k, m in models.items():
            m.reset()
            m.eval(prompt)
            t = time.perf_counter()
            for _ in range(40):
                m.eval([int(rng.integers(100, 20000))])
            res[k].append((time.perf_counter() - t) / 40 * 1000)
    for k, v in res.items():
        print(k, [f"{x:.2f}" for x in v], f"median {np.median(v):.2f} ms")


if __name__ == "__main__":
    main()
