"""The content identity of a model directory: a short sha256 over its config and weight files (config.json,
adapter_config.json, *.safetensors and their index, *.bin), so that a base retrained in place is told apart from
the one an adapter or a checkpoint was trained on, whatever its path. Computed from the files (once per process
and file state); a hub id that is no local directory has none."""

from __future__ import annotations

import hashlib
from pathlib import Path

_MEMO: dict[tuple, str] = {}
_NAMES = ("config.json", "adapter_config.json")
_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin")


def _files(directory: Path) -> list[Path]:
    return sorted(f for f in directory.iterdir()
                  if f.is_file() and (f.name in _NAMES or f.name.endswith(_SUFFIXES)))


def identity(directory) -> str | None:
    """16 hex digits naming the content of `directory`'s model files, or None (no such directory, no files)."""
    if not directory:
        return None
    d = Path(str(directory)).expanduser()
    if not d.is_dir():
        return None
    files = _files(d)
    if not files:
        return None
    state = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if state not in _MEMO:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        _MEMO[state] = h.hexdigest()[:16]
    return _MEMO[state]
