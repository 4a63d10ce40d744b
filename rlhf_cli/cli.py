"""`rlhf <command> [hydra flags] [key=value ...]`: subcommand dispatch over one Hydra app.

Kept import-light (no torch / transformers / trl / peft here) so `--help` and config errors answer in about a
second; each stage imports its heavy libraries inside `run(cfg)`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlhf_cli import schema
from rlhf_cli.config import (
    COMMANDS,
    CONF_DIR,
    CONFIG_ROOT,
    PACKAGE_DIR,
    RECIPES_ENV,
    _quote,
    copy_recipe,
    find_recipes,
    job_dir_name,
    recipe_dirs,
    recipe_names,
    recipe_summary,
    register_resolvers,
    translate_overrides,
)
from rlhf_cli.errors import RlhfError

log = logging.getLogger("rlhf")

# Hydra flags that take a value; Hydra parses a single positional list of overrides, so every flag (and its
# value) has to come before the first override.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp",
                     "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}

HELP = """\
usage: rlhf <command> [recipe=NAME] [key=value ...]

A config-driven RLHF pipeline: supervised fine-tuning, a Bradley-Terry reward model, and PPO with a LoRA policy.

commands (chained through <run_dir>/<stage> directories):
  sft      supervised fine-tuning (trl SFTTrainer)        writes <run_dir>/sft
  reward   Bradley-Terry reward model (trl RewardTrainer) reads sft,          writes <run_dir>/reward
  ppo      PPO, LoRA policy, base as reference            reads sft + reward, writes <run_dir>/ppo
  eval     SFT vs PPO on held-out prompts, plots          reads sft + reward + ppo, writes <run_dir>/eval
  chat     answer prompts from stdin, or prompt="..." once
  export   write the PPO policy as a merged full model    writes <run_dir>/ppo/merged
  doctor   versions, devices, hub reachability and a memory plan for a recipe
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

devices (device=NAME): cpu, cuda, ddp, zero2, zero3, fsdp, cpu-ddp; multi-process ones relaunch `rlhf` under
`accelerate launch` (multi-node: device.num_machines, device.machine_rank, device.main_process_ip).

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
    from rlhf_cli import launch

    if not launch.record_error(message):
        print(f"rlhf{' ' + command if command else ''}: error: {message}", file=sys.stderr)
    sys.exit(code)


# multirun jobs that failed, as "<job>: <error>": main() exits non-zero after the sweep when there are any
_failed_jobs: list[str] = []


def run_stage(cfg) -> dict | None:
    """Run `rlhf_cli.stages.<command>.run(cfg)`, turning errors into one line and a non-zero exit.

    In a multirun the job writes its stage output into its own directory (`job_output`), a failed job is
    reported and the sweep goes on, and the return value tells MultirunSummary where the output is."""
    command = cfg.command
    job = _multirun_job()
    output = job_output(cfg, job) if job is not None else None
    try:
        try:
            if output is not None:
                OmegaConf.update(cfg, output[0], output[1], merge=False)
            schema.validate(cfg)  # every key's type and range, once, before launching or building anything
            rc = _launch(cfg, [f"{output[0]}={_quote(output[1])}"] if output else [])
            if rc is None:
                module = importlib.import_module(f"rlhf_cli.stages.{command}")
                module.run(cfg)
            elif rc:
                return _stop(command, _launch_failure(rc), rc, job)
        finally:
            from rlhf_cli import tracking

            tracking.finish()
    except RlhfError as e:
        if cfg.get("debug"):
            raise
        return _stop(command, str(e), e.exit_code, job)
    except KeyboardInterrupt:
        fail(command, "interrupted; completed outputs are intact (PPO: resume=true continues)", 130)
    except Exception as e:  # noqa: BLE001 - the last line of defence for a CLI
        if cfg.get("debug"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        message = f"{type(e).__name__}: {first} (run again with debug=true for the traceback)"
        return _stop(command, message, 1, job)
    if job is not None:
        return {"command": command, "output_dir": output[1] if output else None, "error": None}
    return None


def _stop(command: str, message: str, code: int, job) -> dict:
    """A failed stage: the one-line error and exit `code`; in a multirun, the line names the job and the
    sweep goes on with the next one."""
    if job is None:
        fail(command, message, code)
    name = job_dir_name(job.job.num, job.job.override_dirname)
    print(f"rlhf {command}: error: job {name}: {message}", file=sys.stderr)
    _failed_jobs.append(f"{name}: {message}")
    return {"command": command, "output_dir": None, "error": message}


def _multirun_job():
    """Hydra's config of this job in a multirun (num, override_dirname, runtime.output_dir), else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return HydraConfig.get()


# where each command writes; a multirun job writes there inside its own directory instead
OUTPUT_KEYS = {"sft": "sft.output_dir", "reward": "reward.output_dir", "ppo": "ppo.output_dir",
               "eval": "eval.output_dir", "export": "export.output_dir"}


def job_output(cfg, job) -> tuple[str, str] | None:
    """(key, `<job dir>/<command>`): the output directory of a multirun job, so that the jobs of a sweep do
    not replace each other's <run_dir>/<command>. The inputs (e.g. reward's SFT model) stay the run's. None
    for commands that write nothing, or when the command line sets the key itself."""
    key = OUTPUT_KEYS.get(str(cfg.command))
    if key is None:
        return None
    if any(o.split("=", 1)[0].lstrip("+~") == key for o in job.overrides.task):
        return None
    return key, str(Path(job.runtime.output_dir) / str(cfg.command))


def _launch_failure(rc: int) -> str:
    """The one-line report of a launch that ended with exit code `rc` (128 + N: ended by signal N)."""
    import signal

    if rc > 128 and rc - 128 in signal.valid_signals():
        name = signal.Signals(rc - 128).name
        return f"the launched processes were stopped by {name} (exit {rc}); see their messages above"
    return f"the launched processes failed (exit {rc}); see their messages above"


def _launch(cfg, extra: list[str] | None = None) -> int | None:
    """Multi-process devices start `rlhf` again under accelerate launch (rlhf_cli.launch); None: run here.
    `extra`: overrides the started processes need besides this run's (a multirun job's output directory)."""
    from hydra.core.hydra_config import HydraConfig

    from rlhf_cli import launch

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if launch.is_launched() and os.environ.get("RANK", "0") != "0":
        logging.getLogger("rlhf").setLevel(logging.WARNING)  # rank 0 reports; the others only warn
    return launch.handle(cfg, [*hc.overrides.task, *(extra or [])], hc.runtime.output_dir)


# ------------------------------------------------------------------------------------------------ multirun
def headline(command: str, output_dir: str | Path | None) -> tuple[str, float | None] | None:
    """The one metric a sweep is compared by, from the job's output: sft eval_loss_end, reward eval_accuracy,
    ppo objective/scores (last update), eval the first win rate. None for commands that report none."""
    if output_dir is None:
        return None
    out = Path(output_dir)
    if command == "eval":
        report = _read_json(out / "report.json")
        rates = report.get("win_rate") or {}
        first = next(iter(rates), None)
        return (f"win_rate/{first}", rates[first]) if first else ("win_rate", None)
    key = {"sft": "eval_loss_end", "reward": "eval_accuracy", "ppo": "objective/scores"}.get(command)
    if key is None:
        return None
    return key, _read_json(out / "metrics.json").get(key)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def summary_lines(rows: list[dict], sweep_dir: Path | None = None) -> list[str]:
    """One aligned line per job: its directory name, its headline metric (or the error), its output (relative
    to `sweep_dir` when inside it)."""
    cells = []
    for r in rows:
        out = r["output_dir"] or ""
        if out and sweep_dir is not None:
            with contextlib.suppress(ValueError):
                out = str(Path(out).resolve().relative_to(sweep_dir.resolve()))
        if r["error"]:
            result = f"failed: {r['error']}"
        elif r["metric"] is None:
            result = "done"
        else:
            value = r["value"]
            result = f"{r['metric']} {value:.4g}" if isinstance(value, (int, float)) else f"{r['metric']} n/a"
        cells.append((r["name"], result, out))
    w0 = max((len(c[0]) for c in cells), default=0)
    w1 = max((len(c[1]) for c in cells if not c[1].startswith("failed")), default=0)
    return [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in cells]


class MultirunSummary:
    """A Hydra callback (conf/config.yaml, hydra.callbacks): after every job of a multirun, rewrites
    <sweep dir>/summary.txt (one line per job with its headline metric) and summary.json, so a sweep that
    stops early still has one; prints it at the end. Does nothing in a single run. Hydra calls every hook
    by name, so all six are here (subclassing hydra's Callback would import Hydra for `rlhf --help`)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.sweep_dir: Path | None = None

    def on_run_start(self, config, **kwargs) -> None:
        pass

    def on_run_end(self, config, **kwargs) -> None:
        pass

    def on_multirun_start(self, config, **kwargs) -> None:
        self.rows, self.sweep_dir = [], Path(str(config.hydra.sweep.dir))

    def on_job_start(self, config, **kwargs) -> None:
        pass

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        command = str(config.command)
        result = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if not isinstance(result, dict):
            result = {"output_dir": None, "error": "failed (see the job's log)"}
        top = headline(command, result.get("output_dir")) if not result.get("error") else None
        self.rows.append({
            "job": int(config.hydra.job.num),
            "name": job_dir_name(config.hydra.job.num, config.hydra.job.override_dirname),
            "overrides": [o for o in job_return.overrides if not o.startswith(("hydra.", "command="))],
            "output_dir": result.get("output_dir"),
            "metric": top[0] if top else None,
            "value": top[1] if top else None,
            "error": result.get("error"),
        })
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self._write(command)

    def on_multirun_end(self, config, **kwargs) -> None:
        if self.rows and self.sweep_dir is not None:
            print(f"rlhf {config.command}: {len(self.rows)} job(s); {self.sweep_dir / 'summary.txt'}:")
            print("\n".join(summary_lines(self.rows, self.sweep_dir)))

    def _write(self, command: str) -> None:
        d = self.sweep_dir
        d.mkdir(parents=True, exist_ok=True)
        head = f"# rlhf {command} multirun in {d}: job, headline metric, output"
        lines = [head, *summary_lines(self.rows, d)]
        (d / "summary.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (d / "summary.json").write_text(json.dumps(self.rows, indent=1) + "\n", encoding="utf-8")


def _dirname_excludes(overrides: list[str]) -> str | None:
    """Hydra names a job's directory after all its overrides (hydra.job.override_dirname); this override
    leaves out the ones every job shares, so the name shows what the sweep varies. None when Hydra's parser
    refuses the overrides (Hydra then reports them itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - reported by Hydra with its own message
        return None
    keys = sorted({o.key_or_group for o in parsed if not o.is_sweep_override() and not o.is_hydra_override()})
    return "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(_quote(k) for k in keys) + "]"


# --------------------------------------------------------------------------------------------------- recipes
RECIPES_USAGE = ("usage: rlhf recipes [list] | rlhf recipes show NAME [key=value ...] | "
                 "rlhf recipes copy NAME [NEW]")


def recipes_command(args: list[str]) -> None:
    """`rlhf recipes ...`: list, show or copy recipes. Composes with Hydra only for `show`."""
    sub, rest = (args[0], args[1:]) if args else ("list", [])
    if sub in ("-h", "--help", "help"):
        print(RECIPES_USAGE)
        return
    try:
        if sub == "list" and not rest:
            print("\n".join(recipe_listing()))
        elif sub == "show" and rest and "=" not in rest[0]:
            print(show_recipe(rest[0], rest[1:]), end="")
        elif sub == "copy" and len(rest) in (1, 2):
            path = copy_recipe(rest[0], rest[1] if len(rest) == 2 else None)
            name = path.stem
            found = find_recipes().get(name)
            used = found is not None and found.path.resolve() == path.resolve()
            print(f"wrote {path}; edit it, then: rlhf sft recipe={name}" if used else
                  f"wrote {path}; it is not in a recipe folder: move it to ./recipes/ or add its folder to "
                  f"${RECIPES_ENV}")
        else:
            fail("recipes", RECIPES_USAGE)
    except RlhfError as e:
        fail("recipes", str(e), e.exit_code)


def recipe_listing() -> list[str]:
    """`rlhf recipes`: one line per recipe (name, where it comes from, its first comment line), user recipes
    marked, and the folders searched."""
    recipes = find_recipes()
    rows = []
    for r in recipes.values():
        where = "shipped" if r.shipped else _short(r.path)
        note = recipe_summary(r.path)
        if r.hides is not None:
            hidden = "the shipped one" if r.hides.resolve().parent == (CONFIG_ROOT / "recipes").resolve() \
                else _short(r.hides)
            note = f"[replaces {hidden}] {note}"
        rows.append((r.name, where, note))
    w0 = max((len(a) for a, _, _ in rows), default=0)
    w1 = max((len(b) for _, b, _ in rows), default=0)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    env = [Path(p).expanduser().resolve() for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep)
           if p.strip()]
    dirs = []
    for d in recipe_dirs():
        if d.resolve() == (CONFIG_ROOT / "recipes").resolve():
            label = f"shipped ({d})"
        elif d.resolve() in env:
            label = f"{d} (${RECIPES_ENV})"
        else:
            label = "./recipes"
        dirs.append(label if d.is_dir() else f"{label}, missing")
    if not env:
        dirs.insert(-1, f"${RECIPES_ENV} (not set; folders separated by '{os.pathsep}')")
    searched = (f"searched in order: {'; '.join(dirs)}\n`rlhf recipes show NAME` prints one composed; "
                "`rlhf recipes copy NAME NEW` writes ./recipes/NEW.yaml to edit")
    return [*lines, "", searched]


def _short(path: Path) -> str:
    """A path relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def show_recipe(name: str, overrides: list[str]) -> str:
    """The config recipe NAME composes to (with `overrides`), as YAML: what `rlhf <command> recipe=NAME --cfg
    job` prints, without the command. Checked against the schema like a run."""
    from rlhf_cli.config import compose

    cfg = compose("sft", [f"recipe={name}", *overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.pop("command", None)
    recipe = find_recipes()[name]
    origin = "shipped" if recipe.shipped else str(recipe.path)
    return f"# recipe {name} ({origin}), composed with {CONF_DIR}\n" + OmegaConf.to_yaml(cfg)


def _hydra_app():
    import hydra

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def app(cfg) -> dict | None:
        return run_stage(cfg)

    return app


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not (CONF_DIR / "config.yaml").is_file():
        fail("", f"no configuration: neither {PACKAGE_DIR / '_config' / 'conf'} (an installed wheel) nor "
                 f"{CONF_DIR} (a checkout) has config.yaml; reinstall rlhf-cli")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP.format(recipes=", ".join(recipe_names())), end="")
        return
    if argv[0] in ("-V", "--version"):
        from rlhf_cli import __version__

        print(f"rlhf {__version__}")
        return
    command = argv[0]
    if command == "recipes":
        recipes_command(argv[1:])
        return
    if command not in COMMANDS:
        fail("", f"unknown command '{command}'; choose one of {', '.join(COMMANDS)}, recipes "
                 "(see `rlhf --help`)")
    flags, overrides = _partition(argv[1:])
    try:
        hydra_overrides = translate_overrides(command, overrides)
    except RlhfError as e:
        fail(command, str(e))
    multirun = any(f in ("-m", "--multirun") for f in flags) and not any(
        f in ("--cfg", "-c", "--info", "-i", "--help", "-h") for f in flags)
    if multirun:
        excludes = _dirname_excludes(hydra_overrides)
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
    _hydra_app()()
    if _failed_jobs:
        fail(command, f"{len(_failed_jobs)} job(s) of the multirun failed: {_failed_jobs[0]}"
                      f"{' (and more, see summary.txt)' if len(_failed_jobs) > 1 else ''}", 1)


if __name__ == "__main__":
    main()
