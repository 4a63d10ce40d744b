"""The tiny recipe on a user's own data file (`data.train_path` other than the demo's).

Three things follow from the file rather than from the shipped demo:
- the tiny model's tokenizer (and the random base built around it) is trained on the file's text, prompts and
  answers (`tokenizer_texts`; rlhf_cli.tiny caches the build by the texts' hash);
- the run directory is named after the file (`run_name`: runs/<recipe>-<file stem>), so the demo's runs/<recipe>
  is left alone;
- SFT of the from-scratch tiny model runs at least `SFT_MIN_STEPS` optimizer steps (`sft_floor`): one epoch of a
  few hundred rows is a few dozen steps, after which the model still writes byte soup.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from rlhf_cli.config import run_name, shipped  # noqa: F401 - here too: where a run goes, shipped data

log = logging.getLogger("rlhf")

# Optimizer steps of SFT on the tiny path with a user's file, unless sft.num_train_epochs / sft.max_steps are
# given (measured: bench/results/NOTES.md, "Own data on the tiny path")
SFT_MIN_STEPS = 500


def user_train_file(data_cfg) -> Path | None:
    """`data.train_path` as a local file when it is not a shipped one (None: the demo's or tiny-math's, or a hub
    name)."""
    from rlhf_cli.config import demo_only
    from rlhf_cli.data import is_hub_name

    path = data_cfg.get("train_path")
    if not path or demo_only(path, True) or is_hub_name(str(path)) or shipped(path):
        return None
    return Path(str(path)).expanduser()


def tokenizer_texts(data_cfg) -> list[str] | None:
    """The prompts' and answers' texts of the user's training file (None: the demo's data, or a hub dataset)."""
    from rlhf_cli import data as D

    path = user_train_file(data_cfg)
    if path is None:
        return None
    examples = D.to_examples(D.read_rows(str(path)), data_cfg.format, str(path), data_cfg.get("system_prompt"))
    return [t for ex in examples for t in (*(str(m.get("content") or "") for m in ex.prompt), ex.chosen,
                                           ex.rejected or "") if t]


def explicit_keys(overrides: list[str]) -> set[str]:
    """The keys set on the command line (`sft.max_steps=10`, `+sft.max_steps=10`, `~key`)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def command_line_overrides() -> list[str]:
    """This run's command-line overrides (Hydra's task overrides; none outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def sft_floor(run, steps_per_epoch: int, overrides: list[str] | None = None) -> int | None:
    """The SFT epochs that give at least SFT_MIN_STEPS optimizer steps, where they apply: the tiny model, a user's
    file, and neither sft.num_train_epochs nor sft.max_steps set (on the command line or away from their defaults:
    1 epoch, no step cap). None where they do not apply or one epoch already has the steps. `run`: the run's
    settings (rlhf_cli.settings.of)."""
    from rlhf_cli.tiny import is_tiny_spec

    s = run.sft
    given = explicit_keys(command_line_overrides() if overrides is None else overrides)
    if (not is_tiny_spec(str(run.model.name_or_path)) or user_train_file(run.data) is None
            or {"sft.num_train_epochs", "sft.max_steps"} & given or int(s.max_steps) > 0
            or float(s.num_train_epochs) != 1):
        return None
    epochs = math.ceil(SFT_MIN_STEPS / max(steps_per_epoch, 1))
    if epochs <= 1:
        return None
    log.info("sft: %d steps per epoch on %s; training %d epochs (%d steps, the tiny model's floor of %d for your "
             "own data; sft.num_train_epochs or sft.max_steps sets it)", steps_per_epoch, run.data.train_path,
             epochs, epochs * steps_per_epoch, SFT_MIN_STEPS)
    return epochs


def steps_per_epoch(n_rows: int, kwargs: dict) -> int:
    """Optimizer steps per epoch of `n_rows` under trainer kwargs (per-device batch × accumulation × processes)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return math.ceil(n_rows / (kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] * world))
