#!/usr/bin/env bash
# Creates .venv and installs hybrid_ray with everything it needs; safe to run again.
# torch is installed first, pinned: a bare `torch` requirement resolves to a multi-GB CUDA build
# on a machine without a GPU. Set TORCH_SPEC (e.g. "torch==2.11.0") to choose another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/pip install -q -e ".[test]"
.venv/bin/python -c "import hybrid_ray, torch, ray, mlflow; print('hybrid_ray ready: torch', torch.__version__, 'ray', ray.__version__, 'mlflow', mlflow.__version__)"
