#!/usr/bin/env bash
# Creates bench/.venv-trl112: an isolated environment with TRL 1.12.0, the last
# release that ships trl.experimental.ppo (PPOTrainer). Idempotent.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${HERE}/.venv-trl112"
PY="${VENV}/bin/python"

# Pinned set, checked together on CPU (python 3.11).
TORCH_PIN="torch==2.13.0"
PINS=(
  "trl==1.12.0"
  "transformers==5.24.0"
  "tokenizers==0.23.3"
  "accelerate==1.15.0"
  "peft==0.21.2"
  "datasets==5.2.0"
  "psutil==7.2.2"
)

if [ -x "${PY}" ] && "${PY}" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version("trl") == "1.12.0" else 1)
PYEOF
then
  echo "bench/.venv-trl112 already has trl 1.12.0; nothing to do"
  exit 0
fi

if [ ! -x "${PY}" ]; then
  python3 -m venv "${VENV}"
fi
# torch first and pinned: an unpinned torch would pull a very large CUDA build.
"${PY}" -m pip install --quiet "${TORCH_PIN}"
"${PY}" -m pip install --quiet "${TORCH_PIN}" "${PINS[@]}"
"${PY}" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
