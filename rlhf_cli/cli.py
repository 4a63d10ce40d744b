"""`rlhf <command> [hydra flags] [key=value ...]`: subcommand dispatch over one Hydra app, and errors as one
line and an exit code. `rlhf recipes` lives in rlhf_cli.recipes, multirun jobs and their summary in
rlhf_cli.multirun, the multi-process launch in rlhf_cli.supervise.

Kept import-light (no torch / transformers / trl / peft here) so `--help` and config errors answer in about a
second; each stage imports its heavy libraries inside `run(cfg)`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import re
import signal
import sys
import threading

from omegaconf import OmegaConf

from rlhf_cli import data, hints, launch, optional, quantization, run_logs, schema, settings, supervise
from rlhf_cli.config import (
    COMMANDS,
    CONF_DIR,
    PACKAGE_DIR,
    job_dir_name,
    quote,
    recipe_names,
    register_resolvers,
    translate_overrides,
)
from rlhf_cli.errors import RlhfError
from rlhf_cli.multirun import current_job, dirname_excludes, job_output
from rlhf_cli.recipes import recipes_command
from rlhf_cli.stage_table import NEEDS_DATA, RESUMABLE, STAGES, stage

log = logging.getLogger("rlhf")

# Hydra flags that take a value; Hydra parses a single positional list of overrides, so every flag (and its
# value) has to come before the first override.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp",
                     "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
_HYDRA_FLAGS = _FLAGS_WITH_VALUE | {"--help", "-h", "--hydra-help", "--version", "--resolve", "--run", "-r",
                                    "--multirun", "-m", "--shell-completion", "-sc"}

HELP = """\
usage: rlhf <command> [recipe=NAME] [key=value ...]

A config-driven RLHF pipeline: supervised fine-tuning, a Bradley-Terry reward model, and PPO with a LoRA policy.

commands (chained through <run_dir>/<stage> directories):
{commands}
  recipes  list the recipes; `recipes show NAME` prints one composed, `recipes copy NAME [NEW]` writes a copy
           to edit (./recipes/NEW.yaml, found before the shipped ones; so are the folders in $RLHF_RECIPES)

recipes (default tiny): {recipes}

examples:
  rlhf sft                                   # tiny recipe: embedded model + demo data, CPU, no downloads
  rlhf ppo ppo.total_episodes=4096 ppo.kl_coef=0.1
  rlhf sft recipe=qwen3-0.6b data.train_path=pairs.jsonl
  rlhf reward model.hub=hf device=cuda
  rlhf sft recipe=qwen3-0.6b device=zero2 device.num_processes=4   # 4 GPUs under accelerate + DeepSpeed
  rlhf ppo device=ddp device.num_processes=8 dry_run=true           # print the multi-GPU launch line
  rlhf doctor recipe=qwen3-0.6b                                     # versions, devices, hubs, memory plan
  rlhf chat prompt="你好"
  rlhf ppo --cfg job                         # print the composed config and exit
  rlhf sft -m sft.learning_rate=1e-3,3e-4    # multirun: one directory per job + summary.txt, under
                                             # <run_dir>/multirun/sft/<time>/
  rlhf recipes copy tiny my-tiny             # ./recipes/my-tiny.yaml; then: rlhf sft recipe=my-tiny

devices (device=NAME; multi-process ones relaunch `rlhf` under `accelerate launch`; multi-node:
device.num_machines, device.machine_rank, device.main_process_ip):
{devices}

Overrides use Hydra's grammar (key=value, +new_key=value, group=option); flags such as --cfg go before them.
`rlhf <command> --help` lists the config groups and the composed config. debug=true shows full tracebacks.
logging.report_to=[tensorboard,wandb] logs to Weights & Biases as well (pip install 'rlhf-cli[wandb]').
"""


def _partition(args: list[str]) -> tuple[list[str], list[str]]:
    flags, overrides = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            flags.append(a)
            if a in _FLAGS_WITH_VALUE and i + 1 < len(args) and "=" not in a:
                flags.append(args[i + 1])
                i += 1
        else:
            overrides.append(a)
        i += 1
    return flags, overrides


def fail(command: str, message: str, code: int = 2) -> None:
    """The one-line error and exit `code`; a process started by a multi-process run leaves the line to the
    process that launched it, which reports the run's errors once."""
    if not supervise.record_error(message):
        print(f"rlhf{' ' + command if command else ''}: error: {message}", file=sys.stderr)
    sys.exit(code)


def hydra_failure(e: BaseException) -> str:
    """One line for an error Hydra raises before the stage runs: an interpolation that cannot be resolved (an
    unset environment variable), a run directory it cannot create, a config it cannot compose."""
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

    chain = [e]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for err in chain:
        missing = hints.missing_option_message(str(err), CONF_DIR)
        if missing:
            return missing
        if isinstance(err, OSError) and err.filename:
            return (f"cannot write the run's directory {err.filename}: {err.strerror}; choose a run_dir that is a "
                    "directory you can write (run_dir=PATH)")
        if isinstance(err, InterpolationResolutionError):
            key = getattr(err, "full_key", None) or "the config"
            env = re.search(r"Environment variable '([^']+)' not found", str(err))
            if env:
                return f"environment variable {env.group(1)} is not set (used by {key}); set it, or give the key " \
                       "that uses it a value on the command line"
            return f"{str(err).splitlines()[0].rstrip('.')} (in {key})"
        if isinstance(err, OmegaConfBaseException):
            key = getattr(err, "full_key", None) or ""
            # a dict value given new keys: `eval.policies={sft: ..., mine: ...}`
            if str(err).startswith("Key '") and "is not in struct" in str(err) and "." in key:
                return (f"{key} is not a key of {key.rsplit('.', 1)[0]}; a new entry is added with a leading +: "
                        f"+{key}=VALUE")
            return str(err).splitlines()[0]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


class Terminated(BaseException):
    """SIGTERM, raised in the main thread: the stage unwinds as it does for Ctrl-C (the output being built is
    removed, checkpoints stay) and ends with one line and exit 143."""


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated


def _resume_hint(cfg) -> str:
    """What continues the stopped stage ("sft.resume=true continues from checkpoint-40")."""
    if cfg.get("command") not in RESUMABLE:
        return "completed outputs are intact"
    try:
        from rlhf_cli.resume import resume_hint

        return resume_hint(cfg)
    except Exception:  # noqa: BLE001 - the line must come out whatever the disk holds
        return "completed outputs are intact"


def _quiet_on_broken_pipe(main):
    """A reader that stops early (`rlhf --help | head -1`) ends the command quietly with exit 141 (128 +
    SIGPIPE, as a shell tool would), not with a BrokenPipeError."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            try:
                return main(*args, **kwargs)
            finally:
                if sys.stdout is not None:
                    sys.stdout.flush()  # here, where a closed pipe can still be caught, rather than at exit
        except BrokenPipeError:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush goes nowhere
            except (OSError, ValueError):
                pass
            sys.exit(141)

    return run


# multirun jobs that failed, as "<job>: <error>": main() exits non-zero after the sweep when there are any
_failed_jobs: list[str] = []


def run_stage(cfg) -> dict | None:
    """Run `rlhf_cli.stages.<command>.run(cfg)`, turning errors into one line and a non-zero exit.

    In a multirun the job writes its stage output into its own directory (`job_output`), a failed job is
    reported and the sweep goes on, and the return value tells MultirunSummary where the output is."""
    command = cfg.command
    job = current_job()
    output = job_output(str(command), job) if job is not None else None
    on_term = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_term else None
    started = False  # past the checks: a refused run leaves no log directory, nor does a command that writes none
    try:
        try:
            if output is not None:
                OmegaConf.update(cfg, output[0], output[1], merge=False)
            schema.validate(cfg)  # every key's type and range, once, before launching or building anything
            schema.check_inputs(cfg)
            typed = settings.of(cfg)  # the checks read the typed settings; the stage builds its own from `cfg`
            quantization.check(typed)  # a quantized full fine-tune, before any model is fetched
            if command in NEEDS_DATA:
                data.check_files(cfg.data)  # before the stage's imports, which take seconds
                data.check_held_out(typed)
            started = True
            rc = _launch(typed, [f"{output[0]}={quote(output[1])}"] if output else [])
            if rc is None:
                optional.hide_unused(typed)  # bitsandbytes / wandb where the run does not use them
                module = importlib.import_module(f"rlhf_cli.stages.{command}")
                module.run(cfg)
            elif rc:
                return _stop(command, _launch_failure(rc), rc, job)
        finally:
            from rlhf_cli import tracking

            tracking.finish()
            _tidy_logs(command, started, failed=sys.exc_info()[1] is not None)
            if on_term:  # the stage is over: SIGTERM does what it did before
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    except RlhfError as e:
        if cfg.get("debug"):
            raise
        return _stop(command, str(e), e.exit_code, job)
    except Terminated:
        fail(command, f"terminated (SIGTERM); {_resume_hint(cfg)}", 143)
    except KeyboardInterrupt:
        fail(command, f"interrupted; {_resume_hint(cfg)}", 130)
    except Exception as e:  # noqa: BLE001 - the last line of defence for a CLI
        if cfg.get("debug"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        message = f"{type(e).__name__}: {first} (run again with debug=true for the traceback)"
        return _stop(command, message, 1, job)
    if job is not None:
        return {"command": command, "output_dir": output[1] if output else None, "error": None}
    return None


def _tidy_logs(command: str, started: bool, failed: bool) -> None:
    """The log directory Hydra made for this run is removed where the run did nothing: refused before the stage
    started, a command that writes no output (doctor, chat), or a stage that failed before logging a line."""
    row = stage(command)
    if not started or not (row.output or row.trains):
        run_logs.remove_unused()
    elif failed:
        run_logs.remove_unused(only_if_silent=True)


def _stop(command: str, message: str, code: int, job) -> dict:
    """A failed stage: the one-line error and exit `code`; in a multirun, the line names the job and the
    sweep goes on with the next one."""
    if job is None:
        fail(command, message, code)
    name = job_dir_name(job.job.num, job.job.override_dirname)
    print(f"rlhf {command}: error: job {name}: {message}", file=sys.stderr)
    _failed_jobs.append(f"{name}: {message}")
    return {"command": command, "output_dir": None, "error": message}


def _launch_failure(rc: int) -> str:
    """The one-line report of a launch that ended with exit code `rc` (128 + N: ended by signal N)."""
    import signal

    if rc > 128 and rc - 128 in signal.valid_signals():
        name = signal.Signals(rc - 128).name
        return f"the launched processes were stopped by {name} (exit {rc}); see their messages above"
    return f"the launched processes failed (exit {rc}); see their messages above"


def _launch(run, extra: list[str] | None = None) -> int | None:
    """Multi-process devices start `rlhf` again under accelerate launch (rlhf_cli.supervise); None: run here.
    `run`: the run's settings (rlhf_cli.settings.of); `extra`: overrides the started processes need besides this
    run's (a multirun job's output directory)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if launch.is_launched() and os.environ.get("RANK", "0") != "0":
        logging.getLogger("rlhf").setLevel(logging.WARNING)  # rank 0 reports; the others only warn
    return supervise.handle(run, [*hc.overrides.task, *(extra or [])], hc.runtime.output_dir)


def _hydra_mode(overrides: list[str]) -> str | None:
    """The value of a `hydra.mode` override (also `+hydra.mode` / `++hydra.mode`), else None."""
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and key.lstrip("+~") == "hydra.mode":
            return value
    return None


@contextlib.contextmanager
def _mode_from_the_command_line():
    """Hydra composes the whole config once more before the run's own composition, only to read `hydra.mode`
    (hydra issue #3440; about a third of a command's start before the stage). rlhf's configs never set it
    (tests/test_config.py), so it is read from the command line, where a user may give it, and otherwise left
    to the flags (`-m`), as Hydra does when the composed config has none."""
    from hydra._internal.hydra import Hydra

    full = Hydra.get_mode

    def get_mode(self, config_name, overrides):
        return full(self, config_name, overrides) if _hydra_mode(overrides) is not None else None

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = full


def _hydra_app():
    import hydra

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def app(cfg) -> dict | None:
        return run_stage(cfg)

    return app


@_quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not (CONF_DIR / "config.yaml").is_file():
        fail("", f"no configuration: neither {PACKAGE_DIR / '_config' / 'conf'} (an installed wheel) nor "
                 f"{CONF_DIR} (a checkout) has config.yaml; reinstall rlhf-cli")
    if not argv or argv[0] in ("-h", "--help", "help"):
        commands = "\n".join(f"  {s.name:<8} {s.summary}" for s in STAGES)
        devices = "\n".join(f"  {name:<8} {what}" for name, what in hints.group_summaries(CONF_DIR, "device"))
        print(HELP.format(commands=commands, recipes=", ".join(recipe_names()), devices=devices), end="")
        return
    if argv[0] in ("-V", "--version"):
        from rlhf_cli import __version__

        print(f"rlhf {__version__}")
        return
    command = argv[0]
    if command == "recipes":
        try:
            recipes_command(argv[1:])
        except RlhfError as e:
            fail("recipes", str(e), e.exit_code)
        return
    if command not in COMMANDS:
        fail("", f"unknown command '{command}'; choose one of {', '.join(COMMANDS)}, recipes "
                 "(see `rlhf --help`)")
    flags, overrides = _partition(argv[1:])
    try:
        hints.flag_as_key(command, argv[1:], {*schema.SCHEMA, "model", "data", "device"}, _HYDRA_FLAGS)
        hydra_overrides = translate_overrides(command, overrides)
    except RlhfError as e:
        fail(command, str(e))
    if any(f in ("-h", "--help") for f in flags):  # the keys with their help; Hydra's own page: --hydra-help
        from rlhf_cli.keyhelp import command_help

        try:
            print(command_help(command, overrides), end="")
        except RlhfError as e:
            fail(command, str(e))
        return
    multirun = (any(f in ("-m", "--multirun") for f in flags) or _hydra_mode(overrides) == "MULTIRUN") and not any(
        f in ("--cfg", "-c", "--info", "-i", "--help", "-h") for f in flags)
    if multirun:
        excludes = dirname_excludes(hydra_overrides)
        if excludes:
            hydra_overrides.append(excludes)
    register_resolvers()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("RANK", "0") != "0" and any(k in os.environ for k in ("LOCAL_RANK", "WORLD_SIZE")):
        # started by a launcher, not the main process: rank 0 keeps the run's config and log files and prints
        # the results; the others keep stderr (warnings, errors) only
        hydra_overrides += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    sys.argv = [f"rlhf {command}", *flags, *hydra_overrides]
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's own failures come here as exceptions, not its multi-line report
    try:
        with _mode_from_the_command_line():
            _hydra_app()()
    except Exception as e:  # noqa: BLE001 - raised before or around the stage (which reports its own errors)
        fail(command, hydra_failure(e))
    if _failed_jobs:
        fail(command, f"{len(_failed_jobs)} job(s) of the multirun failed: {_failed_jobs[0]}"
                      f"{' (and more, see summary.txt)' if len(_failed_jobs) > 1 else ''}", 1)


if __name__ == "__main__":
    main()
