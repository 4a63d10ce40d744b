#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index: the Python packages rlhf needs beyond what such a
# machine's image brings (its CUDA torch, tokenizers, safetensors, numpy, pandas, pyarrow, tensorboard, ...), at
# the versions installed in this checkout's .venv (the versions the tests pass with), for the machine's Python.
# bench/gpu_check.sh installs what .whl/ holds on top of the machine's own python3 when .whl/ is there. ModelScope
# is left out (its client needs cryptography): the check builds its models locally and downloads nothing.
#
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12; writes .whl/ (about 25 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PKGS=(transformers huggingface_hub kernels peft accelerate trl datasets dill multiprocess hydra-core omegaconf
      antlr4-python3-runtime pytest-timeout httpx2 httpcore2 truststore tomlkit hf-xet idna anyio click)
PINS=()
for p in "${PKGS[@]}"; do
  v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] || { echo "$p is not installed in .venv: run make install first" >&2; exit 1; }
  PINS+=("$p==$v")
done
rm -rf .whl && mkdir .whl
for pin in "${PINS[@]}"; do
  # a binary wheel for that Python where one exists; else a wheel built here from the source (pure Python ones:
  # antlr4-python3-runtime has no wheel on the index)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$pin" 2>/dev/null || python3 -m pip wheel -q --no-deps -w .whl "$pin"
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
ls .whl && du -sh .whl
