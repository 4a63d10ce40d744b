#!/usr/bin/env bash
# Creates bench/.venv-rlhf: a private copy of the project's environment (.venv) that only the benchmark runs.
#
# Why a copy: peak RSS counts the library pages a process maps, and how many a page fault maps depends on how the
# file sits in the page cache. bench/run.py drops the clean page cache before the timed runs, but pages that other
# processes keep mapped (tests or CLI runs of .venv on a shared machine) cannot be dropped; `import torch` alone
# then measured 282 MB from .venv against 224 MB from a fresh copy or from bench/.venv-trl112. With both sides in
# benchmark-private environments, both map their libraries from a dropped cache. The copy is refreshed when the
# set of installed distributions in .venv changes (rlhf_cli itself is an editable install: the copy runs the
# working tree's code).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="${HERE}/../.venv"
DST="${HERE}/.venv-rlhf"
STAMP="${DST}/.bench-copy-of"

if [ ! -x "${SRC}/bin/python" ]; then
  echo "no ${SRC}: run 'make install' first" >&2
  exit 1
fi
want="$(ls "${SRC}"/lib/python3*/site-packages | grep -E '\.dist-info$' | sort | sha256sum | cut -c1-16)"
if [ -f "${STAMP}" ] && [ "$(cat "${STAMP}")" = "${want}" ]; then
  echo "bench/.venv-rlhf matches .venv; nothing to do"
  exit 0
fi
rm -rf "${DST}.tmp"
cp -a "${SRC}" "${DST}.tmp"
echo "${want}" > "${DST}.tmp/.bench-copy-of"
rm -rf "${DST}"
mv "${DST}.tmp" "${DST}"
"${DST}/bin/python" -c "import rlhf_cli, torch; print('bench/.venv-rlhf: rlhf_cli from', rlhf_cli.__file__, 'torch', torch.__version__)"
