"""Starting a multi-process run and watching it: `handle` decides whether this `rlhf` process runs the stage
or relaunches itself under `accelerate launch` (the line and settings come from `rlhf_cli.launch`), starts
the launcher, waits for it and reports how it ended.

The launch never outlives the `rlhf` process that started it: the launcher runs in its own session, the
signals this process gets (TERM, INT, HUP) go to that whole group, every way out of the wait ends the group,
and on Linux the launcher and each started process get SIGTERM from the kernel when their parent dies, even
of SIGKILL (`prctl(PR_SET_PDEATHSIG)`).

A started process that fails leaves its one-line error in a folder the launching process made (`ERRORS_ENV`)
instead of printing it; the launching process reports the run's error once: the message alone when every
process failed the same way, else each message with the ranks that gave it.

Kept import-light: no torch here.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from rlhf_cli.errors import RlhfError
from rlhf_cli.launch import (
    TRAIN_COMMANDS,
    check_launch,
    check_stage_support,
    child_overrides,
    is_launched,
    launch_argv,
    num_processes,
    quiet_launch_argv,
    strategy,
    uses_config_file,
    write_accelerate_config,
)

log = logging.getLogger("rlhf")

# the pid of the `rlhf` process that ran `accelerate launch`, in the environment of everything it started
PARENT_ENV = "RLHF_LAUNCH_PARENT_PID"
# received by the launching process and passed on to the launcher's process group
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
# the folder (made by the launching process) where each started process of this machine leaves its error line
ERRORS_ENV = "RLHF_LAUNCH_ERRORS"
# after asking the launcher to stop: how long to wait before killing it (torch's agent gives its workers 30 s)
STOP_GRACE_S = 40.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def handle(run, task_overrides: list[str], log_dir: str | Path) -> int | None:
    """Relaunch under accelerate when the device of the run's settings (`run`: rlhf_cli.settings.of) asks for
    several processes (or print the line with dry_run).

    Returns None when the stage should run in this process, else the exit code to leave with.
    """
    command = str(run.command)
    overrides = child_overrides(task_overrides)
    dry = bool(run.get("dry_run"))
    if command == "doctor":
        return None
    if is_launched():
        die_with_launcher()
        check_stage_support(run)
        return None
    single_line = shlex.join([sys.executable, "-m", "rlhf_cli.cli", command, *overrides])
    s = strategy(run.device)
    if command not in TRAIN_COMMANDS:
        if s != "single":
            log.info("%s runs in one process; device.strategy=%s applies to sft, reward and ppo", command, s)
        if dry:
            print(single_line)
            return 0
        return None
    check_stage_support(run)
    check_launch(run)
    if s == "single":
        if dry:
            print(single_line)
            return 0
        return None
    config_file = write_accelerate_config(run, log_dir) if uses_config_file(run) else None
    argv = launch_argv(run, overrides, config_file)
    line = shlex.join(argv)
    if dry:
        print(line)
        if config_file is not None:
            print(f"# {config_file}:")
            body = Path(config_file).read_text(encoding="utf-8").splitlines()[1:]
            print("\n".join("#   " + ln for ln in body))
        return 0
    if s == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise RlhfError(f"device={run.device.name} needs DeepSpeed: pip install '.[deepspeed]' "
                            "(or pip install deepspeed)")
    n = num_processes(run.device)
    log.info("launching %d process(es) per machine: %s", n, line)
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="rlhf-errors-") as errors:
        rc = run_launcher(quiet_launch_argv(argv), {**env, ERRORS_ENV: errors})
        message = launch_errors(errors, n) if rc else None
    if message:
        raise LaunchFailed(message, rc)
    return rc


class LaunchFailed(RlhfError):
    """The started processes failed: their errors in one line; exit with the launcher's code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def record_error(message: str) -> bool:
    """In a process started by `handle`: leave `message` for the launching process to report (True). False
    anywhere else (not started by rlhf, or the folder is gone): the caller prints it itself."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder or not is_launched():
        return False
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    path = Path(folder) / f"rank-{rank}"
    try:
        part = path.with_name(path.name + ".part")
        part.write_text(message, encoding="utf-8")
        os.replace(part, path)
    except OSError:
        return False
    return True


def launch_errors(folder: str | Path, processes: int) -> str | None:
    """The errors the started processes left in `folder` as one line (None: none left one). The message alone
    when all `processes` failed with it; otherwise each distinct message after the ranks that gave it."""
    ranks: dict[str, list[int]] = {}
    for path in Path(folder).glob("rank-*"):
        number = path.name[len("rank-"):]
        if number.isdigit():
            message = path.read_text(encoding="utf-8").strip()
            ranks.setdefault(message, []).append(int(number))
    if not ranks:
        return None
    if len(ranks) == 1 and len(next(iter(ranks.values()))) >= processes:
        return next(iter(ranks))
    parts = []
    for message, rs in sorted(ranks.items(), key=lambda item: min(item[1])):
        rs = sorted(rs)
        who = f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))
        parts.append(f"{who}: {message}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------- process lifetime
def _prctl():
    """libc's prctl on Linux (looked up before any fork: loading a library in a forked child can deadlock),
    else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int = signal.SIGTERM, prctl=None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; False elsewhere).

    Strictly it fires when the parent *thread* that started this process ends; the launchers start their
    processes from their main thread."""
    prctl = prctl or _prctl()
    if prctl is None:
        return False
    try:
        return prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - an optional safety net; never a reason to fail the run
        return False


def die_with_launcher() -> None:
    """In a process started by torchrun / accelerate launch: end (SIGTERM) when the launcher ends.

    torch's agent stops its workers when it gets SIGTERM / SIGINT / SIGHUP, but it starts each of them in a
    session of its own, so a launcher that is killed outright (SIGKILL, OOM) would leave them running, blocked
    in a collective on a peer that is gone. Called early in each started process (`handle`)."""
    if not is_launched() or not set_parent_death_signal(signal.SIGTERM):
        return
    parent = os.environ.get(PARENT_ENV)
    if parent is None:
        return  # started by a launcher the user ran: the death signal is all we can arm
    # the launcher (or the `rlhf` process above it) may already have died before the signal was armed
    if os.getppid() == 1 or not _pid_alive(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def _pid_alive(pid: str | int) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _launcher_preexec(parent: int, prctl):
    """Runs in the launcher between fork and exec: SIGTERM when `parent` dies; exit if it already has."""

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return setup


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_launcher(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the launcher's process group (its agent passes it to the workers), SIGKILL after `grace_s`.
    Only while the launcher has not been reaped: afterwards its pid (= the group id) may belong to another
    process."""
    if proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def exit_code(rc: int) -> int:
    """A Popen return code as a shell reports it: death by signal N -> 128 + N."""
    return 128 - rc if rc < 0 else rc


def run_launcher(argv: list[str], env: dict) -> int:
    """Run the launch command in its own session and wait for it; it does not outlive this process.

    TERM / INT / HUP received here go to the launcher's group (a second one: SIGKILL); any other way out of
    the wait (an exception) stops the group; if this process is killed outright, the launcher gets SIGTERM
    from the kernel (Linux). Returns the launcher's exit code (128 + N after signal N); raises
    KeyboardInterrupt after a forwarded SIGINT, once the launcher has ended."""
    parent = os.getpid()
    env = {**env, PARENT_ENV: str(parent)}
    if os.name != "posix":  # no sessions or process groups to manage
        return exit_code(subprocess.call(argv, env=env))
    proc = subprocess.Popen(argv, env=env, start_new_session=True,
                            preexec_fn=_launcher_preexec(parent, _prctl()))
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        if proc.returncode is None:
            _signal_group(proc.pid, signum if len(received) == 1 else signal.SIGKILL)

    previous = {}
    try:
        for name in FORWARDED_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    previous[sig] = signal.signal(sig, forward)
                except ValueError:  # not the main thread: the exit paths below still stop the group
                    break
        rc = proc.wait()
    finally:
        stop_launcher(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        log.warning("stopped the launched processes on %s", signal.Signals(received[0]).name)
        if received[0] == signal.SIGINT:
            raise KeyboardInterrupt
        return 128 + int(received[0])
    return exit_code(rc)
