"""Trains an EAGLE-3 head for the Qwen2.5-Coder 1.5B on the first N records of
data/qwen-coder-1.5b-written, reading target features from an existing cache (the background
`specdec train eagle` run's), to time a training step and take a point of the learning curve
while the full extraction is still running.

    python experiments/eagle/qwen15_subset.py N MAX_STEPS OUT [FEATURE_CACHE] [THREADS] [--resume]

N is a record count (the first N) or ``cached``: every record whose features the cache already
holds, so nothing is extracted. Stop the background run first (SIGTERM saves its cache);
records not in the cache are extracted.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.target import load_model
from specdec.training.eagle import EagleTrainConfig, train_eagle
from specdec.training.feature_cache import record_digest
from specdec.training.records import SelfDistilledData
from specdec.training.shards import load_token_data

DATA = Path(__file__).resolve().parents[2] / "data" / "qwen-coder-1.5b-written"


def main() -> None:
    resume = "--resume" in sys.argv  # continue OUT's last checkpoint
    sys.argv = [a for a in sys.argv if a != "--resume"]
    n, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    cache = (
        Path(sys.argv[4]) if len(sys.argv) > 4 else Path.home() / "eagle-qwen15/head/features-train"
    )
    torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else 2)
    loaded = load_model("qwen2.5-coder-1.5b")
    full = load_token_data(DATA, loaded)
    if n == "cached":
        kept = set(json.loads((cache / "index.json").read_text())["kept"])
        records = [r for r in full.records if record_digest(r) in kept]
    else:
        records = full.records[: int(n)]
    data = SelfDistilledData(full.manifest, records)
    config = EagleTrainConfig(context=192, max_steps=steps, eval_every=max(steps // 4, 1),
                              checkpoint_every=min(100, max(steps // 2, 1)))  # fmt: skip
    t = time.perf_counter()
    r = train_eagle(loaded, data, out, config, progress=tqdm, feature_cache=cache,
                    resume=resume)  # fmt: skip
    took = time.perf_counter() - t - r.feature_seconds
    print(f"{len(records)} records, {r.train_positions} train positions, {r.steps} steps in "
          f"{took:.0f} s "
          f"({took / max(r.steps, 1):.1f} s a step; features {r.feature_seconds:.0f} s); "
          f"held-out simulated tau {r.simulated_tau:.3f}, step accuracy "
          f"{[round(a, 3) for a in r.step_accuracy]}, draft-vocab coverage "
          f"{r.draft_vocab_coverage:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
