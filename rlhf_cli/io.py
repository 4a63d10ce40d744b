"""Atomic stage outputs: build in a hidden sibling directory, rename into place only on success."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces `final` when the block succeeds.

    A failure (exception, Ctrl-C) removes the temporary directory and leaves an earlier `final` untouched.
    The swap is two renames on one filesystem: the old output is moved aside, the new one moved in, then the
    old one deleted; a crash between the renames leaves the old output as `.<name>.old-<pid>` beside it.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: str | Path, obj) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_json(path: str | Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))
