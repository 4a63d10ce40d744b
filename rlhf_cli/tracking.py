"""Where training metrics go: TensorBoard, and Weights & Biases beside it when `logging.report_to` lists
wandb.

sft and reward hand the list to trl's trainer (`report_to`); transformers' WandbCallback then starts the wandb
run itself and takes everything but the metrics from the WANDB_* environment, which `trainer_report_to` fills
in from `logging.wandb`. The PPO loop writes through `make_writer`, which has SummaryWriter's three calls.

wandb is an extra (`pip install 'rlhf-cli[wandb]'`). With `logging.wandb.mode=offline` (or WANDB_MODE=offline)
it needs no account or network and keeps each run under `<logging.wandb.dir>/wandb/` for a later `wandb sync`.
Imports neither torch nor wandb until a backend is used.
"""

from __future__ import annotations

import html
import importlib.util
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlhf_cli.choices import REPORT_TO
from rlhf_cli.errors import RlhfError

BACKENDS = REPORT_TO  # logging.report_to


def _logging(run, *path: str, default=None):
    """`logging.<path>` of the run's settings (rlhf_cli.settings.of); `default` where they hold no value (a view
    holds None for a key the config lacks: an older conf/ without the logging group)."""
    node = run.get("logging")
    for name in path:
        node = node.get(name) if node is not None else None
    return default if node is None else node


def report_to(run) -> list[str]:
    """`logging.report_to` of the run's settings as a list ([tensorboard] when the config has no logging group: an
    older conf/)."""
    value = _logging(run, "report_to", default=["tensorboard"])
    backends = [value] if isinstance(value, str) else list(value or [])
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise RlhfError(f"logging.report_to: {', '.join(map(str, unknown))} is unknown; use a list of "
                        f"{', '.join(BACKENDS)}, e.g. logging.report_to=[tensorboard,wandb]")
    return backends


def require_wandb() -> None:
    if importlib.util.find_spec("wandb") is None:
        raise RlhfError("logging.report_to lists wandb but wandb is not installed: pip install "
                        "'rlhf-cli[wandb]' (or pip install wandb), or drop it "
                        "(logging.report_to=[tensorboard])")


def run_name(run) -> str:
    """`logging.wandb.name`, else `<recipe>-<command>`, and in a multirun the job's directory name
    (`tiny-sft-1_sft.learning_rate=0.0003`), so that the jobs of a sweep tell apart."""
    name = _logging(run, "wandb", "name")
    if name:
        return str(name)
    name = f"{run.recipe}-{run.command}"
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        from rlhf_cli.config import job_dir_name

        job = HydraConfig.get().job
        name += "-" + job_dir_name(job.num, job.override_dirname)
    return name


def wandb_settings(run) -> dict:
    """wandb.init's project, entity, name, group, mode and dir from `logging.wandb` (None: wandb decides, from
    its WANDB_* environment or its defaults). The directory is made absolute and created: wandb falls back to
    a temporary one when it is missing."""
    w = _logging(run, "wandb") or {}
    directory = Path(str(w.get("dir") or run.run_dir)).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return {"project": w.get("project") or "rlhf", "entity": w.get("entity"), "name": run_name(run),
            "group": w.get("group"), "mode": w.get("mode"), "dir": str(directory)}


def wandb_env(settings: dict) -> dict[str, str]:
    """The WANDB_* variables that carry `settings` to a wandb.init that is not ours (transformers'
    WandbCallback passes only the project, from WANDB_PROJECT). Unset settings leave the user's own."""
    names = {"project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "name": "WANDB_NAME",
             "group": "WANDB_RUN_GROUP", "mode": "WANDB_MODE", "dir": "WANDB_DIR"}
    return {env: str(settings[key]) for key, env in names.items() if settings.get(key) is not None}


def trainer_report_to(run) -> list[str]:
    """`report_to` for trl's SFTConfig / RewardConfig ([] logs nowhere). With wandb in it: checks that wandb
    is installed and exports the run's settings (`run`: rlhf_cli.settings.of) for the trainer's WandbCallback."""
    backends = report_to(run)
    if "wandb" in backends:
        require_wandb()
        os.environ.update(wandb_env(wandb_settings(run)))
    return backends


def _config_dict(cfg) -> dict:
    """The composed config for the wandb run's config panel (unresolved where a value cannot be resolved)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - a display aid; the stage has validated what it uses
        return OmegaConf.to_container(cfg, resolve=False)


class Writer:
    """SummaryWriter's add_scalar / add_text / close, written to TensorBoard and/or a wandb run. Without
    either (processes other than the main one, or logging.report_to=[]) every call does nothing."""

    def __init__(self, tensorboard=None, wandb_run=None, hooks=None):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run
        self._hooks = hooks  # (sys.exit, sys.excepthook) before wandb.init replaced them, put back on close

    @property
    def enabled(self) -> bool:
        return self.tensorboard is not None or self.wandb_run is not None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            # same-step calls gather into one row; wandb commits it when a later step arrives
            self.wandb_run.log({tag: value}, step=int(step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_text(tag, text, step)
        if self.wandb_run is not None:
            import wandb

            # the text is a markdown table (TensorBoard renders it); wandb shows it as written
            self.wandb_run.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=int(step))

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self._hooks is not None:  # wandb's exit hook turns a later sys.exit() into sys.exit(0)
            sys.exit, sys.excepthook = self._hooks
            self._hooks = None


def make_writer(run, log_dir: str | Path, is_main: bool, *, composed) -> Writer:
    """The PPO loop's metric writer: TensorBoard events in `log_dir` and/or a wandb run, as `logging.report_to`
    of the run's settings (`run`: rlhf_cli.settings.of) says, on the main process only (the others get a Writer
    that does nothing). `composed`: the composed config itself (a DictConfig), the wandb run's config."""
    if not is_main:
        return Writer()
    backends = report_to(run)
    if "wandb" in backends:
        require_wandb()
    tensorboard = wandb_run = hooks = None
    if "tensorboard" in backends:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = SummaryWriter(str(log_dir))
    if "wandb" in backends:
        import wandb

        settings = {k: v for k, v in wandb_settings(run).items() if v is not None}
        hooks = (sys.exit, sys.excepthook)
        wandb_run = wandb.init(config=_config_dict(composed), **settings)
    return Writer(tensorboard, wandb_run, hooks)


def finish() -> None:
    """End a wandb run this process still has open: a multirun runs its jobs in one process, and each job's
    trainer would otherwise log into the first job's run. Never imports wandb."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
