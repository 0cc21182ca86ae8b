"""A view of a self-distilled data directory that holds only some of its shards: a manifest
listing those shards and links to their files, so a training run on a past subset (the shards a
shipped head was trained on, or only the ones added since) can be repeated as the data grows.

    python scripts/data_subset.py data/sharegpt-smol --shards 10: --out /tmp/smol-new
    python scripts/data_subset.py data/sharegpt-smol --shards :10 --out /tmp/smol-first10

``--shards`` is a Python slice over the manifest's shard list (in generation order).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--shards", required=True, help="slice of the shard list, e.g. 10: or :10")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    manifest = json.loads((args.data / "manifest.json").read_text())
    try:
        parts = [int(p) if p else None for p in args.shards.split(":")]
        picked = manifest["shards"][slice(*parts)]
    except (ValueError, TypeError):
        ap.error(f"--shards must be a slice such as 10: or 0:10, got {args.shards!r}")
    if not picked:
        ap.error(f"--shards {args.shards} selects none of the {len(manifest['shards'])} shards")
    args.out.mkdir(parents=True, exist_ok=True)
    for shard in picked:
        link = args.out / shard["file"]
        if not link.exists():
            link.symlink_to((args.data / shard["file"]).resolve())
    manifest["shards"] = picked
    manifest["records"] = sum(s["records"] for s in picked)
    manifest["tokens"] = sum(s["tokens"] for s in picked)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{args.out}: {len(picked)} shards, {manifest['records']} answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
