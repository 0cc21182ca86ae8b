"""Copy a trained EAGLE drafter into the package as the shipped head, weights in float16.

    python scripts/ship_eagle_head.py TRAINED_DIR [--dest DIR] [--command 'specdec train ...']

Float16 halves the checkpoint (39 MB -> 20 MB for the bundled model's EAGLE-3 head); the loader
casts back to the target's dtype, a change of at most ~1e-3 in any weight. The training record
in the drafter's config (data, settings, steps, wall time, held-out figures) is kept and also
written out as TRAINING.md next to it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

DEFAULT_DEST = (
    Path(__file__).resolve().parents[1] / "src/specdec/heads/bundled/eagle3-smollm2-135m-instruct"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trained", type=Path)
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--command", default="", help="the training command, for TRAINING.md")
    args = ap.parse_args()
    src, dest = args.trained, args.dest
    config = json.loads((src / "config.json").read_text())
    training = config["specdec"]["extra"].get("training", {})
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dest / "config.json")
    state = load_file(src / "model.safetensors")
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    save_file(half, str(dest / "model.safetensors"))
    lines = [
        "# The shipped EAGLE-3 head for SmolLM2-135M-Instruct",
        "",
        "Loaded by `--speculator eagle` on the bundled model (no path needed); weights in float16.",
        "",
    ]
    if args.command:
        lines += ["Trained with:", "", "```bash", args.command, "```", ""]
    lines += ["Training record (from `config.json`):", "", "```json"]
    lines += [json.dumps(training, indent=1), "```", ""]
    (dest / "TRAINING.md").write_text("\n".join(lines))
    print(f"wrote {dest} ({(dest / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
