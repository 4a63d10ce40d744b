"""Atomic stage outputs: build in a hidden sibling directory, rename into place only on success.

Every output directory carries a small marker file (`.rlhf-output`), so that a later run replaces only what
rlhf itself wrote: an existing non-empty directory without the marker is refused, never deleted.

In a multi-process run (torchrun / accelerate launch) every process enters the same block, but only the main
process (global rank 0) creates, renames and deletes directories; the others wait for it at a barrier."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from rlhf_cli.errors import RlhfError

OUTPUT_MARKER = ".rlhf-output"


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


# ------------------------------------------------------------------------------------------ ownership marker
def _write_marker(directory: Path) -> None:
    """Mark `directory` as written by rlhf. The pid and host let a later run tell whether the writer of a
    leftover temporary directory is still alive."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    marker = {"written_by": "rlhf", "time": now, "pid": os.getpid(), "host": socket.gethostname()}
    (directory / OUTPUT_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")


def _is_marked(directory: Path) -> bool:
    return (directory / OUTPUT_MARKER).is_file()


def check_output_dir(final: str | Path) -> None:
    """Raise unless `final` may be replaced: it does not exist, is an empty directory, or was written by rlhf
    (it, or the output directory it lies in, carries the marker; e.g. `ppo/merged`). Reads only, changes
    nothing, so a refused run leaves the disk as it was."""
    final = Path(final)
    if final.is_symlink():
        raise RlhfError(f"{final} is a symbolic link and rlhf replaces its output directories; give the real "
                        "directory path, or choose a new output directory")
    if not final.exists():
        return
    if not final.is_dir():
        raise RlhfError(f"{final} exists and is a file, not an output directory of rlhf; choose an empty or "
                        "new output directory, or delete it yourself")
    if _is_marked(final) or _is_marked(final.parent) or not any(final.iterdir()):
        return
    raise RlhfError(f"{final} exists and was not written by rlhf (no {OUTPUT_MARKER} marker); choose an "
                    "empty or new output directory, or delete it yourself")


# --------------------------------------------------------------------------------- leftovers of killed runs
PID_MAX = 1 << 22  # Linux's largest pid_max: a longer number is a launcher's id, not a process


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # exists but belongs to another user, or cannot tell: keep its files
    return True


def _writer_pid(directory: Path, kind: str, tag: str) -> int | None:
    """The process on this host that left `directory`, or None when unknown (then it is kept).

    `.old-<pid>` is named by the process that moved it aside. A `.tmp-<tag>` carries a marker from its
    creation: its pid is the real writer even when the tag is a launcher's port; a marker from another host of
    a shared filesystem cannot be checked here."""
    if kind == "tmp":
        try:
            marker = json.loads((directory / OUTPUT_MARKER).read_text(encoding="utf-8"))
            if marker.get("host") != socket.gethostname():
                return None
            return int(marker["pid"]) if 0 < int(marker["pid"]) <= PID_MAX else None
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass  # killed before its marker was written: judge by the tag
    return int(tag) if tag.isdigit() and 0 < int(tag) <= PID_MAX else None


def _clean_leftovers(final: Path, tag: str, keep: Path | None = None) -> None:
    """Remove `.<name>.tmp-<tag>` / `.<name>.old-<tag>` beside `final` left by this launch (same tag) or by a
    process that is gone. Tags that are not pids (a launcher's run id) are kept unless they are ours;
    `.<name>.partial` (a resumable PPO run) never matches."""
    parent = final.parent
    if not parent.is_dir():
        return
    for kind in ("tmp", "old"):
        prefix = f".{final.name}.{kind}-"
        for path in parent.glob(f"{prefix}*"):
            other = path.name[len(prefix):]
            if path == keep or path.is_symlink() or not path.is_dir():
                continue
            if other == tag:
                shutil.rmtree(path, ignore_errors=True)
            elif other.isdigit():
                pid = _writer_pid(path, kind, other)
                if pid is not None and not _pid_alive(pid):
                    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- publishing
def publish(src: str | Path, final: str | Path) -> None:
    """Move the finished directory `src` into place as `final` (a sibling on the same filesystem).

    The old output, if any, is renamed aside to `.<name>.old-<pid>`, `src` renamed to `final`, then the old
    one deleted; a crash between the renames leaves `.<name>.old-<pid>`, which the next run removes. Refuses
    (RlhfError, nothing changed) when `final` holds something rlhf did not write. The main process alone calls
    this."""
    src, final = Path(src), Path(final)
    check_output_dir(final)
    tag = str(os.getpid())
    _clean_leftovers(final, tag, keep=src)
    _write_marker(src)
    old = final.parent / f".{final.name}.old-{tag}"
    if final.exists():
        final.rename(old)
    try:
        src.rename(final)
    except BaseException:
        if old.exists() and not final.exists():
            old.rename(final)  # put the earlier output back
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, every_rank: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that replaces `final` when the block succeeds.

    A failure (exception, Ctrl-C) removes the temporary directory and leaves an earlier `final` untouched.
    An existing `final` that rlhf did not write is refused before anything is created (see check_output_dir);
    temporary siblings of killed runs are removed. The swap itself is `publish`.

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
        check_output_dir(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(final, tag)  # includes a `tmp` left by a killed run with the same tag
        tmp.mkdir()
        _write_marker(tmp)  # written now too, so a leftover of this run names its process
    try:
        yield tmp
    except BaseException:
        if owner:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if shared:
        _barrier()  # every process has finished writing (collective saves included)
    if owner:
        try:
            publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
