"""One run per output: the process that writes an output holds an exclusive `flock` on `.<name>.lock` beside it
(JSON inside names the holder) while it builds and publishes it, so that a second run into the same directory is
refused at once with a line naming the first. The kernel drops the lock when its process ends however it ends,
so a lock file left by a killed run is recognised as stale and taken over with a log line. rlhf_cli.io takes it
around every output it publishes."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhf_cli.errors import RlhfError
from rlhf_cli.stage_table import OUTPUT_STAGES

log = logging.getLogger("rlhf")

STAGE_KINDS = OUTPUT_STAGES  # the stages whose output directory is locked and marked by kind


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def command_line() -> str:
    """This process's command line, for markers and locks: `rlhf ppo ppo.total_episodes=64` (the CLI sets
    argv[0] to `rlhf <command>`; its own Hydra plumbing is left out)."""
    argv = sys.argv or ["python"]
    head = argv[0] if argv[0].startswith("rlhf ") else Path(argv[0]).name
    args = [a for a in argv[1:] if not a.startswith(("hydra.", "command="))]
    return f"{head} {shlex.join(args)}".strip()[:500]


def output_key(kind: str | None) -> str:
    return f"{kind}.output_dir" if kind in STAGE_KINDS else "output directory"


PID_MAX = 1 << 22  # Linux's largest pid_max: a longer number is a launcher's id, not a process


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # exists but belongs to another user, or cannot tell: keep its files
    return True


@dataclass
class _Hold:
    fd: int
    pid: int        # the process that took it (a forked child inherits the table, not the hold)
    count: int = 1  # nested holds in this process (a block inside a claim, a rerun in one process)


_held: dict[Path, _Hold] = {}   # lock file -> this process's hold
_claims: set[Path] = set()      # holds that last until `publish` (claim_output)
_atexit_armed = False


def _lock_file(final: Path) -> Path:
    return Path(os.path.abspath(final.parent / f".{final.name}.lock"))


def _holder(fd: int) -> dict:
    """The JSON body of an open lock file: who holds (or last held) it; {} when empty or unreadable."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(os.pread(fd, 65536, 0).decode("utf-8", "replace") or "{}")
        if isinstance(doc, dict):
            return doc
    return {}


def _pid_state(holder: dict) -> str:
    """What can be told here of the process named in a lock file: ' (which has exited)', ' (on another host,
    ...)' (a shared filesystem: its pid means nothing here), or ''."""
    if holder.get("host") != socket.gethostname():
        return " (on another host, which this one cannot check)"
    with contextlib.suppress(TypeError, ValueError):
        pid = int(holder.get("pid"))
        if 0 < pid <= PID_MAX and not pid_alive(pid):
            return " (which has exited)"
    return ""


def _who(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, `{holder.get('command', '?')}`, "
            f"since {holder.get('since', '?')}")


def _busy(final: Path, kind: str | None, lock: Path, fd: int) -> RlhfError:
    """The one line for a second run: who holds the lock (the holder writes its name just after locking)."""
    holder = {}
    for _ in range(20):
        holder = _holder(fd)
        if holder:
            break
        time.sleep(0.05)
    if not holder:
        return RlhfError(f"{final} is in use by another run (it holds {lock}); wait for it to end, or choose "
                         f"another {output_key(kind)}")
    state = _pid_state(holder)
    if state == " (which has exited)":
        state = " (which has exited, but a process it started still holds the lock)"
    elif state:
        state = " (on another host)"
    return RlhfError(f"{final} is in use by another run: {_who(holder)}{state}; wait for it to end or stop it, or "
                     f"choose another {output_key(kind)}")


def acquire(final: Path, kind: str | None) -> Path:
    """Take (or, held by this process already, re-enter) the run lock of `final`; its lock file's path."""
    lock = _lock_file(final)
    hold = _held.get(lock)
    if hold is not None and hold.pid == os.getpid():
        hold.count += 1
        return lock
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RlhfError(f"cannot create the lock file {lock} ({e.strerror}); rlhf writes it beside "
                            f"{final} while a run writes there: choose a writable {output_key(kind)}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            err = _busy(final, kind, lock, fd)
            os.close(fd)
            raise err from None
        except OSError as e:
            os.close(fd)
            raise RlhfError(f"cannot lock {lock} ({e.strerror}); rlhf locks an output so that two runs never "
                            f"write into one: choose a {output_key(kind)} on a local filesystem") from e
        try:
            same = os.path.samestat(os.stat(lock), os.fstat(fd))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder ended and removed the file between our open and lock: take the new one
    previous = _holder(fd)
    if previous:
        log.warning("%s: taking over a stale lock %s left by %s%s; no process holds it any more", final,
                    lock.name, _who(previous), _pid_state(previous))
    body = {"pid": os.getpid(), "host": socket.gethostname(), "command": command_line(), "since": now(),
            "output": str(final)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(body) + "\n").encode("utf-8"), 0)
    global _atexit_armed
    if not _atexit_armed:
        atexit.register(release_all)  # an exception or Ctrl-C that ends the process; a kill leaves a stale file
        _atexit_armed = True
    _held[lock] = _Hold(fd, os.getpid())
    return lock


def release(lock: Path, *, all_of_it: bool = False) -> None:
    """Give back one hold of `lock` (all of them: `all_of_it`); the last one unlocks and removes the file."""
    hold = _held.get(lock)
    if hold is None or hold.pid != os.getpid():
        return
    hold.count = 0 if all_of_it else hold.count - 1
    if hold.count > 0:
        return
    del _held[lock]
    _claims.discard(lock)
    with contextlib.suppress(OSError):
        if os.path.samestat(os.stat(lock), os.fstat(hold.fd)):
            os.unlink(lock)  # before the unlock: a run that opened it meanwhile sees it gone and opens anew
    os.close(hold.fd)


def release_all() -> None:
    for lock in list(_held):
        release(lock, all_of_it=True)


@contextlib.contextmanager
def output_lock(final: str | Path, kind: str | None = None) -> Iterator[None]:
    """Hold the run lock of `final` for the block (atomic_dir takes it itself)."""
    lock = acquire(Path(final), kind)
    try:
        yield
    finally:
        release(lock)


def claim_output(final: str | Path, kind: str | None = None) -> None:
    """Take the run lock of `final` and keep it until `publish` moves a directory into `final` (or fails), or
    this process ends: for PPO, whose `.<name>.partial` build directory (covered by the same lock) lives across
    the whole stage. Taking it again in the same process is a no-op."""
    lock = _lock_file(Path(final))
    if lock in _claims:
        return
    acquire(Path(final), kind)
    _claims.add(lock)


def release_output(final: str | Path) -> None:
    """Give back a claim taken with `claim_output` (nothing when there is none)."""
    lock = _lock_file(Path(final))
    if lock in _claims:
        _claims.discard(lock)
        release(lock)
