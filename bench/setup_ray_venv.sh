#!/usr/bin/env bash
# Creates bench/.ray-venv, the Ray side of the benchmark, unless it already
# imports Ray Train and torch. torch 2.13.0 is a local CPU wheel that pip
# finds through its own config (find-links / extra index).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.ray-venv"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import ray.train.torch, torch, lightning, transformers, xgboost, jax, PIL" 2>/dev/null; then
    echo "$venv is ready"
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install 'ray[train]==2.60.0' torch==2.13.0
"$venv/bin/python" -c "import ray, torch; print('ray', ray.__version__, 'torch', torch.__version__)"
# The framework side of bench/frameworks.py (torch stays the CPU build: scripts/constraints.txt).
"$venv/bin/pip" install -c "$here/../scripts/constraints.txt" lightning transformers accelerate xgboost-cpu jax
# Ray Data's read_images (bench/data_ingest.py) decodes with Pillow, which ray[train] does not bring.
"$venv/bin/pip" install -c "$here/../scripts/constraints.txt" pillow
