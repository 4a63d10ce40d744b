"""Atomic stage outputs: build in a hidden sibling directory, rename into place only on success.

Every output directory carries a small marker file (`.rlhf-output`) naming the stage that wrote it (its kind:
sft, reward, ppo, eval, export, or a PPO checkpoint) and the run, so that a stage replaces only its own kind of
output: a directory without the marker, one that holds another stage's output, an input of the same command, or
anything inside another output is refused, never deleted (`check_output_dir`).

One run per output: rlhf_cli.run_lock's lock beside the output, held while a run builds and publishes it.

In a multi-process run (torchrun / accelerate launch) every process enters the same block, but only the main
process (global rank 0) locks, creates, renames and deletes directories; the others wait for it at a barrier."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from rlhf_cli.errors import RlhfError
from rlhf_cli.run_lock import (
    PID_MAX,
    STAGE_KINDS,
    acquire,
    command_line,
    now,
    output_key,
    pid_alive,
    release,
    release_output,
)
from rlhf_cli.stage_table import BY_NAME, OUTPUT_STAGES

log = logging.getLogger("rlhf")

OUTPUT_MARKER = ".rlhf-output"
KINDS = (*STAGE_KINDS, "checkpoint")  # what a marker's "kind" names: the stage that wrote it, or a PPO checkpoint
# markers of earlier versions name no kind: a stage still replaces one in the directory it writes by default
# (`export` writes <ppo>/merged, or <job>/export in a multirun)
_LEGACY_NAMES = {name: BY_NAME[name].legacy_dirs for name in OUTPUT_STAGES}

Inputs = Iterable[str | Path | None]  # the directories a command reads: never its output


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


def _show(path: Path) -> str:
    """`path` for an error line: relative to the working directory when it lies below it."""
    with contextlib.suppress(ValueError, OSError):
        return str(path.relative_to(Path.cwd().resolve()))
    return str(path)


# ------------------------------------------------------------------------------------------ ownership marker
def _write_marker(directory: Path, kind: str | None = None) -> None:
    """Mark `directory` as written by rlhf's `kind` stage in this run. The pid and host also let a later run
    tell whether the writer of a leftover temporary directory is still alive."""
    marker = {"written_by": "rlhf", "kind": kind, "command": command_line(), "time": now(), "pid": os.getpid(),
              "host": socket.gethostname()}
    (directory / OUTPUT_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")


def _is_marked(directory: Path) -> bool:
    return (directory / OUTPUT_MARKER).is_file()


def _marker(directory: Path) -> dict | None:
    """The marker's fields; None when `directory` has none, {} when it cannot be read (still rlhf's)."""
    try:
        text = (directory / OUTPUT_MARKER).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return {} if _is_marked(directory) else None
    with contextlib.suppress(ValueError):
        doc = json.loads(text)
        if isinstance(doc, dict):
            return doc
    return {}


def output_kind(directory: str | Path) -> str | None:
    """The kind of rlhf output `directory` holds (the stage that wrote it), or None (not rlhf's, or unknown)."""
    marker = _marker(Path(directory))
    kind = (marker or {}).get("kind")
    return kind if kind in KINDS else None


def _holds(directory: Path) -> str:
    """What `directory` holds, in words, for an error line."""
    marker = _marker(directory)
    if marker is not None:
        kind = marker.get("kind")
        if kind == "checkpoint":
            return "a PPO checkpoint"
        when = f", written {marker['time']}" if isinstance(marker.get("time"), str) else ""
        if kind in STAGE_KINDS:
            return f"the {kind} stage's output{when}"
        return f"an rlhf output of an earlier version whose marker names no stage{when}"
    with contextlib.suppress(OSError):
        ckpts = sorted(p.name for p in directory.glob("checkpoint-*") if p.is_dir())
        if ckpts:
            return f"PPO checkpoints ({', '.join(ckpts[:3])}{', ...' if len(ckpts) > 3 else ''})"
        outputs = sorted(p.name for p in directory.iterdir() if p.is_dir() and _is_marked(p))
        if outputs:
            return f"rlhf outputs ({', '.join(outputs[:4])}{', ...' if len(outputs) > 4 else ''})"
    return "files that rlhf did not write"


def _merged_of_ppo(kind: str | None, where: Path, parent: Path) -> bool:
    """Export's default target, the `merged` folder of a PPO output (`ppo.merge=true` writes one too): the one
    place a stage writes inside another's output."""
    if kind != "export" or where.name != "merged" or where.parent != parent:
        return False
    owner = (_marker(parent) or {}).get("kind")
    return owner == "ppo" or (owner is None and parent.name in _LEGACY_NAMES["ppo"])


def check_output_dir(final: str | Path, kind: str | None = None, inputs: Inputs = ()) -> None:
    """Raise unless rlhf's `kind` stage may replace `final`: it does not exist or is an empty directory, or it
    holds that stage's own output (its marker names `kind`; a marker of an earlier version, which names no kind,
    only in the stage's default directory, e.g. `sft` for sft). Always refused: another stage's output, a PPO
    checkpoint, any folder without the marker, one of the command's `inputs` (or a folder holding one), and
    anything inside another output (save export's `<ppo>/merged`). `kind=None` (tests, tools) replaces only
    outputs whose marker names no kind. Reads only, changes nothing, so a refused run leaves the disk as it was."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}; one of {', '.join(KINDS)}")  # a caller's mistake
    final = Path(final)
    key = output_key(kind)
    if final.is_symlink():
        raise RlhfError(f"{final} is a symbolic link and rlhf replaces its output directories; give the real "
                        "directory path, or choose a new output directory")
    if final.exists() and not final.is_dir():
        raise RlhfError(f"{final} exists and is a file, not an output directory of rlhf; choose an empty or "
                        "new output directory, or delete it yourself")
    where = final.resolve()
    stage = f"`rlhf {kind}`" if kind in STAGE_KINDS else "this command"
    for given in inputs:
        if given is None or str(given) == "":
            continue
        inp = Path(str(given)).expanduser()
        if not inp.exists():
            continue
        src = inp.resolve()
        if src == where:
            raise RlhfError(f"{final} is an input of {stage} (it holds {_holds(src)}); write the output "
                            f"elsewhere: choose another {key}")
        if where in src.parents:
            raise RlhfError(f"{final} contains {inp}, an input of {stage}; write the output elsewhere: choose "
                            f"another {key}")
    if kind != "checkpoint":  # checkpoints are written by PPO into its own build directory, never by a user
        for parent in where.parents:
            if not _is_marked(parent):
                continue
            if _merged_of_ppo(kind, where, parent):
                break
            raise RlhfError(f"{final} is inside {_show(parent)}, which holds {_holds(parent)}; an output never "
                            f"goes inside another one: choose another {key} outside it")
    if not final.exists() or not any(final.iterdir()):
        return
    marker = _marker(final)
    if marker is None:
        if _merged_of_ppo(kind, where, where.parent):
            return  # ppo.merge=true wrote it as part of the PPO output
        holds = _holds(final)
        if holds.startswith("files"):
            raise RlhfError(f"{final} exists and was not written by rlhf (no {OUTPUT_MARKER} marker); choose an "
                            "empty or new output directory, or delete it yourself")
        raise RlhfError(f"{final} holds {holds}, which rlhf never replaces; choose an empty or new {key}, or "
                        "delete it yourself")
    other = marker.get("kind")
    if other == kind:
        return
    if other is None and (kind is None or final.name in _LEGACY_NAMES.get(kind, ())
                          or (kind == "checkpoint" and final.name.startswith("checkpoint-"))):
        return
    who = {None: "a writer of no stage", "checkpoint": "a PPO checkpoint"}.get(kind, f"`rlhf {kind}`")
    raise RlhfError(f"{final} holds {_holds(final)}; {who} replaces only its own output: choose another {key}, "
                    "or delete it yourself")


# --------------------------------------------------------------------------------- leftovers of killed runs
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
                if pid is not None and not pid_alive(pid):
                    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- publishing
def publish(src: str | Path, final: str | Path, kind: str | None = None, inputs: Inputs = ()) -> None:
    """Move the finished directory `src` into place as `final` (a sibling on the same filesystem), marked as
    the `kind` stage's output.

    The old output, if any, is renamed aside to `.<name>.old-<pid>`, `src` renamed to `final`, then the old
    one deleted; a crash between the renames leaves `.<name>.old-<pid>`, which the next run removes. Refuses
    (RlhfError, nothing changed) what `check_output_dir(final, kind, inputs)` refuses. Gives back a claim on
    `final` (claim_output) whether it succeeds or not. The main process alone calls this."""
    src, final = Path(src), Path(final)
    try:
        check_output_dir(final, kind, inputs)
        tag = str(os.getpid())
        _clean_leftovers(final, tag, keep=src)
        _write_marker(src, kind)
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
    finally:
        release_output(final)


@contextlib.contextmanager
def atomic_dir(final: str | Path, kind: str | None = None, inputs: Inputs = (), *,
               every_rank: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that replaces `final` when the block succeeds, marked as the `kind` stage's
    output (sft, reward, ppo, eval, export, checkpoint).

    A failure (exception, Ctrl-C) removes the temporary directory and leaves an earlier `final` untouched.
    What `check_output_dir(final, kind, inputs)` refuses (`inputs`: the directories the command reads) is
    refused before anything is created; then the run lock of `final` is taken for the block (a second run into
    `final` is refused, naming this one) and temporary siblings of killed runs are removed. The swap itself is
    `publish`. A checkpoint takes no lock of its own: the PPO run that writes it holds its build directory's.

    every_rank=True: all processes of a distributed run enter the block and get the same path; only the main
    process checks, locks, creates and renames it (it alone should write into it), and the others wait at a
    barrier until the output is in place. every_rank=False: only the calling process enters (e.g. a checkpoint
    that the main process writes).
    """
    final = Path(final)
    rank, world = process_rank()
    shared = every_rank and world > 1
    tag = _run_tag() if shared else str(os.getpid())
    owner = rank == 0 or not shared
    tmp = final.parent / f".{final.name}.tmp-{tag}"
    lock = None
    if owner:
        check_output_dir(final, kind, inputs)
        if kind != "checkpoint":
            lock = acquire(final, kind)
    try:
        if owner:
            final.parent.mkdir(parents=True, exist_ok=True)
            _clean_leftovers(final, tag)  # includes a `tmp` left by a killed run with the same tag
            tmp.mkdir()
            _write_marker(tmp, kind)  # written now too, so a leftover of this run names its process
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
                publish(tmp, final, kind, inputs)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if shared:
            _barrier()  # nobody goes on before `final` is in place
    finally:
        if lock is not None:
            release(lock)


def write_json(path: str | Path, obj) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_json(path: str | Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))
