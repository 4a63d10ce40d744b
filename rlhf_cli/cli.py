"""`rlhf <command> [hydra flags] [key=value ...]`: subcommand dispatch over one Hydra app.

Kept import-light (no torch / transformers / trl / peft here) so `--help` and config errors answer in about a
second; each stage imports its heavy libraries inside `run(cfg)`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from rlhf_cli import schema
from rlhf_cli.config import COMMANDS, CONF_DIR, recipe_names, register_resolvers, translate_overrides
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

recipes (recipes/*.yaml; default tiny): {recipes}

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
  rlhf sft -m sft.learning_rate=1e-3,3e-4    # Hydra multirun sweep

devices (device=NAME): cpu, cuda, ddp, zero2, zero3, fsdp, cpu-ddp; multi-process ones relaunch `rlhf` under
`accelerate launch` (multi-node: device.num_machines, device.machine_rank, device.main_process_ip).

Overrides use Hydra's grammar (key=value, +new_key=value, group=option); flags such as --cfg go before them.
`rlhf <command> --help` lists the config groups and the composed config. debug=true shows full tracebacks.
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
    print(f"rlhf{' ' + command if command else ''}: error: {message}", file=sys.stderr)
    sys.exit(code)


def run_stage(cfg) -> None:
    """Run `rlhf_cli.stages.<command>.run(cfg)`, turning errors into one line and a non-zero exit."""
    command = cfg.command
    try:
        schema.validate(cfg)  # every key's type and range, once, before launching or building anything
        rc = _launch(cfg)
        if rc is not None:
            if rc:
                fail(command, _launch_failure(rc), rc)
            return
        module = importlib.import_module(f"rlhf_cli.stages.{command}")
        module.run(cfg)
    except RlhfError as e:
        if cfg.get("debug"):
            raise
        fail(command, str(e), e.exit_code)
    except KeyboardInterrupt:
        fail(command, "interrupted; completed outputs are intact (PPO: resume=true continues)", 130)
    except Exception as e:  # noqa: BLE001 - the last line of defence for a CLI
        if cfg.get("debug"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        fail(command, f"{type(e).__name__}: {first} (run again with debug=true for the traceback)", 1)


def _launch_failure(rc: int) -> str:
    """The one-line report of a launch that ended with exit code `rc` (128 + N: ended by signal N)."""
    import signal

    if rc > 128 and rc - 128 in signal.valid_signals():
        name = signal.Signals(rc - 128).name
        return f"the launched processes were stopped by {name} (exit {rc}); see their messages above"
    return f"the launched processes failed (exit {rc}); see their messages above"


def _launch(cfg) -> int | None:
    """Multi-process devices start `rlhf` again under accelerate launch (rlhf_cli.launch); None: run here."""
    from hydra.core.hydra_config import HydraConfig

    from rlhf_cli import launch

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if launch.is_launched() and os.environ.get("RANK", "0") != "0":
        logging.getLogger("rlhf").setLevel(logging.WARNING)  # rank 0 reports; the others only warn
    return launch.handle(cfg, list(hc.overrides.task), hc.runtime.output_dir)


def _hydra_app():
    import hydra

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def app(cfg) -> None:
        run_stage(cfg)

    return app


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP.format(recipes=", ".join(recipe_names())), end="")
        return
    if argv[0] in ("-V", "--version"):
        from rlhf_cli import __version__

        print(f"rlhf {__version__}")
        return
    command = argv[0]
    if command not in COMMANDS:
        fail("", f"unknown command '{command}'; choose one of {', '.join(COMMANDS)} (see `rlhf --help`)")
    flags, overrides = _partition(argv[1:])
    try:
        hydra_overrides = translate_overrides(command, overrides)
    except RlhfError as e:
        fail(command, str(e))
    register_resolvers()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("RANK", "0") != "0" and any(k in os.environ for k in ("LOCAL_RANK", "WORLD_SIZE")):
        # started by a launcher, not the main process: rank 0 keeps the run's config and log files and prints
        # the results; the others keep stderr (warnings, errors) only
        hydra_overrides += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    sys.argv = [f"rlhf {command}", *flags, *hydra_overrides]
    _hydra_app()()


if __name__ == "__main__":
    main()
