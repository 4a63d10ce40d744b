"""Atomic stage outputs: build in a hidden sibling directory, rename into place only on success.

In a multi-process run (torchrun / accelerate launch) every process enters the same block, but only the main
process (global rank 0) creates, renames and deletes directories; the others wait for it at a barrier."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path


def _dist():
    """torch.distributed when a process group is up (never imports torch itself), else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def process_rank() -> tuple[int, int]:
    """(global rank, world size): from torch.distributed if initialised, else the launcher's environment."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return process_rank()[0] == 0


def _run_tag() -> str:
    """A name every process of one launch agrees on: the launcher's run id or port (the same for all ranks),
    else this process id."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        for key in ("TORCHELASTIC_RUN_ID", "MASTER_PORT"):
            value = os.environ.get(key, "")
            if value and value != "none":
                return "".join(c if c.isalnum() or c in "-_" else "_" for c in value)
    return str(os.getpid())


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, every_rank: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that replaces `final` when the block succeeds.

    A failure (exception, Ctrl-C) removes the temporary directory and leaves an earlier `final` untouched.
    The swap is two renames on one filesystem: the old output is moved aside, the new one moved in, then the
    old one deleted; a crash between the renames leaves the old output as `.<name>.old-<tag>` beside it.

    every_rank=True: all processes of a distributed run enter the block and get the same path; only the main
    process creates and renames it (it alone should write into it), and the others wait at a barrier until the
    output is in place. every_rank=False: only the calling process enters (e.g. a checkpoint that the main
    process writes).
    """
    final = Path(final)
    rank, world = process_rank()
    shared = every_rank and world > 1
    tag = _run_tag() if shared else str(os.getpid())
    owner = rank == 0 or not shared
    tmp = final.parent / f".{final.name}.tmp-{tag}"
    if owner:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a killed run with the same tag
            shutil.rmtree(tmp)
        tmp.mkdir(exist_ok=True)
    try:
        yield tmp
    except BaseException:
        if owner:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if shared:
        _barrier()  # every process has finished writing (collective saves included)
    if owner:
        old = final.parent / f".{final.name}.old-{tag}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
    if shared:
        _barrier()  # nobody goes on before `final` is in place


def write_json(path: str | Path, obj) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_json(path: str | Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))
