"""How tests start the real `rlhf` command: one thread, no hub access, unbuffered output."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

RLHF = Path(sys.executable).with_name("rlhf")
# a few-step run evaluates on 32 held-out rows instead of the demo's 300 (what such a test checks does not
# depend on them; the learning tests keep theirs)
EVAL_ROWS = "data.max_eval_rows=32"


def cli_env(**more: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **more)


def rlhf(cwd: Path, *args: str, timeout: float = 1500, stdin: str = "") -> subprocess.CompletedProcess:
    """`rlhf ARGS` in `cwd`, its output captured: in this process (`run_cli_in_process`), or the console script
    (else `python -m rlhf_cli.cli`) with RLHF_TEST_CLI=process."""
    if in_process():
        rc, out, err = run_cli_in_process(Path(cwd), args, stdin=stdin)
    else:
        rc, out, err = run_cli_process(Path(cwd), args, timeout=timeout, stdin=stdin)
    return subprocess.CompletedProcess(["rlhf", *map(str, args)], rc, out, err)


# --- the CLI in-process -------------------------------------------------------------------------------------------
# `run_cli` calls the CLI's entry function in the test process (STYLE.md 5: tests run the real CLI in-process),
# which saves a new interpreter and ~9 s of imports per call. Everything a finished process would drop is put
# back afterwards: working directory, environment, argv, std streams and file descriptors 1/2, signal handlers,
# logging and warning state, torch threads / dtype / RNG, Hydra's and accelerate's singletons, and rlhf's own
# locks. RLHF_TEST_CLI=process starts the console script instead, for every call (the two must agree).
# Tests of process behaviour (signals, kill -9, two runs at once) start processes themselves.

_DEFAULT_WARNINGS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                     ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                     ("ignore", ResourceWarning, ""))  # a fresh interpreter's filters (python -W unset)


def in_process() -> bool:
    return os.environ.get("RLHF_TEST_CLI", "in-process") != "process"


def run_cli_process(cwd: Path, args, timeout: float = 1500, stdin: str = "") -> tuple[int, str, str]:
    """`rlhf ARGS` as a new process: the console script, else `python -m rlhf_cli.cli`."""
    exe = [str(RLHF)] if RLHF.exists() else [sys.executable, "-m", "rlhf_cli.cli"]
    proc = subprocess.run([*exe, *map(str, args)], cwd=str(cwd), env=cli_env(), input=stdin, capture_output=True,
                          text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def run_cli_in_process(cwd: Path, args, stdin: str = "") -> tuple[int, str, str]:
    """`rlhf ARGS` through `rlhf_cli.cli.main` in this process: (exit code, stdout, stderr)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-cli-") as tmp, _process_state(Path(cwd), stdin, Path(tmp)) as got:
        rc = _call_main([str(a) for a in args])
    return rc, got["out"], got["err"]


def _call_main(argv: list[str]) -> int:
    from rlhf_cli.cli import main

    try:
        main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what the interpreter would print before exiting 1
        traceback.print_exc()
        return 1
    return 0


@contextlib.contextmanager
def _process_state(cwd: Path, stdin: str, tmp: Path):
    import logging
    import random
    import signal
    import warnings

    import torch
    import transformers  # noqa: F401 - imported before any in-process run: a run never hides bitsandbytes or
    # wandb from this process (rlhf_cli.optional), which later QLoRA and wandb tests in it load

    got: dict[str, str] = {}
    saved_env, saved_argv, saved_cwd = dict(os.environ), list(sys.argv), os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    saved_torch = (torch.get_num_threads(), torch.get_default_dtype(), torch.get_rng_state(), random.getstate())
    saved_logging = _logging_state(logging)
    saved_hooks = (sys.exit, sys.excepthook)  # wandb's run replaces both (its exit makes sys.exit() exit 0)
    os.environ.update(cli_env())
    os.chdir(cwd)
    try:
        _drop_singletons(keep_locks=True)  # a library test before may have left some
        with warnings.catch_warnings(), _std_streams(tmp, stdin, got):
            warnings.resetwarnings()
            for action, category, module in _DEFAULT_WARNINGS:
                warnings.filterwarnings(action, category=category, module=module)
            warnings.showwarning = warnings._showwarning_orig
            yield got
    finally:
        _drop_singletons()
        _restore_logging(logging, saved_logging)
        sys.exit, sys.excepthook = saved_hooks
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        torch.set_num_threads(saved_torch[0])
        torch.set_default_dtype(saved_torch[1])
        torch.set_rng_state(saved_torch[2])
        random.setstate(saved_torch[3])
        os.chdir(saved_cwd)
        sys.argv[:] = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)


@contextlib.contextmanager
def _std_streams(tmp: Path, stdin: str, got: dict):
    """stdout / stderr to files, at the descriptors too (the launched processes and C code write there)."""
    paths = {1: tmp / "stdout", 2: tmp / "stderr"}
    saved_streams = (sys.stdin, sys.stdout, sys.stderr)
    for stream in saved_streams[1:]:
        with contextlib.suppress(Exception):
            stream.flush()
    saved_fds = {fd: os.dup(fd) for fd in paths}
    try:
        for fd, path in paths.items():
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False,  # noqa: SIM115
                          buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,  # noqa: SIM115
                          buffering=1)
        sys.stdin = io.StringIO(stdin)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        for fd, copy in saved_fds.items():
            os.dup2(copy, fd)
            os.close(copy)
        for fd, key in ((1, "out"), (2, "err")):
            got[key] = paths[fd].read_text(encoding="utf-8", errors="replace")


def _logging_state(logging) -> dict:
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return {"loggers": {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers},
            "disable": logging.root.manager.disable}


def _restore_logging(logging, state: dict) -> None:
    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if not isinstance(lg, logging.Logger):
            continue
        for handler in lg.handlers:
            if handler not in state["loggers"].get(lg, ((),))[0]:
                with contextlib.suppress(Exception):
                    handler.close()
        handlers, level, propagate, disabled = state["loggers"].get(lg, ([], logging.NOTSET, True, False))
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
    logging.disable(state["disable"])


_FROZEN = {"modules": 0}  # how many modules were imported at the last gc.freeze()


def _drop_singletons(keep_locks: bool = False) -> None:
    """What the end of a process would drop: Hydra's global config, wandb's and accelerate's state, a process
    group, the failed-job list of a multirun, and (unless keep_locks: the test's own) rlhf's output locks."""
    import gc

    import torch
    from accelerate.state import AcceleratorState, GradientState
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from rlhf_cli import cli, run_lock

    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
    if "wandb" in sys.modules:  # its process-wide setup holds the directory and settings of its first run
        sys.modules["wandb"].teardown()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    run_lock.release_all()
    cli._failed_jobs.clear()
    gc.collect()
    # what is alive now that libraries were imported since the last freeze (their modules, caches and classes, and
    # for the first call those of pytest) lives as long as this process: frozen, each later collection (two per
    # CLI call) skips it; unfrozen, a collection after torch and transformers are in walks ~360k objects
    if len(sys.modules) > _FROZEN["modules"]:
        gc.freeze()
        _FROZEN["modules"] = len(sys.modules)
