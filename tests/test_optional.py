"""rlhf_cli.optional: a new process never imports bitsandbytes without model.quantization, nor wandb without wandb
in logging.report_to (transformers, trl and peft import both whenever they are installed); a run that uses them
imports them. Each case is a new interpreter, as a stage's process is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from rlhf_cli import optional
from rlhf_cli.config import compose
from rlhf_cli.settings import of
optional.hide_unused(of(compose("sft", sys.argv[1:])))
import peft, trl.trainer.base_trainer  # what a stage imports: both import the optional ones they find
from transformers import is_wandb_available
from transformers.utils import is_bitsandbytes_available
print(sys.modules.get("bitsandbytes") is not None, is_bitsandbytes_available(),
      sys.modules.get("wandb") is not None, is_wandb_available())
"""


@pytest.mark.parametrize("overrides,bnb,wandb", [
    ([], False, False),
    (["model.quantization=4bit"], True, False),
    (["logging.report_to=[tensorboard,wandb]"], False, True),
])
def test_a_new_process_imports_only_the_optional_libraries_its_run_uses(overrides, bnb, wandb):
    for name, wanted in (("bitsandbytes", bnb), ("wandb", wandb)):
        if wanted:
            pytest.importorskip(name)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *overrides], capture_output=True, text=True, check=False,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(bnb), str(bnb), str(wandb), str(wandb)]


def test_a_process_that_imported_transformers_keeps_what_it_has():
    """The test process runs the CLI in-process after its own imports: nothing is hidden from it."""
    from rlhf_cli import optional
    from rlhf_cli.config import compose
    from rlhf_cli.settings import of

    pytest.importorskip("transformers")
    before = sys.modules.get("bitsandbytes", "absent"), sys.modules.get("wandb", "absent")
    optional.hide_unused(of(compose("sft", [])))
    assert (sys.modules.get("bitsandbytes", "absent"), sys.modules.get("wandb", "absent")) == before
    assert optional.unused(of(compose("sft", []))) == ["bitsandbytes", "wandb"]


def test_the_setup_of_a_stage_leaves_datasets_unimported_and_quiet_when_it_comes():
    """ppo, eval, chat and export read their data without datasets: the stage's setup (which silences the
    libraries) does not import it, and a later import (a hub dataset) starts without progress bars or notices.
    A new interpreter: this process imported datasets long ago."""
    script = ("import sys\nfrom rlhf_cli.config import compose\nfrom rlhf_cli.hardware import setup_torch\n"
              "from rlhf_cli.settings import of\nsetup_torch(of(compose('ppo', ['device.threads=1'])))\n"
              "print('datasets' in sys.modules)\nimport datasets\n"
              "print(datasets.logging.get_verbosity() == datasets.logging.ERROR,"
              " datasets.utils.are_progress_bars_disabled())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("DATASETS_VERBOSITY", "HF_DATASETS_DISABLE_PROGRESS_BARS")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True", "True"]
