"""Optional libraries that a run does not use are never imported into its process.

transformers, trl and peft import bitsandbytes (the [qlora] extra) and wandb (the [wandb] extra) whenever they are
installed, whether the run quantizes or logs to wandb or not: together about a third of a stage's start-up
(bitsandbytes pulls in torch's compiler), and bitsandbytes prints a line about a kernel hub. A run without
`model.quantization` hides bitsandbytes, one without wandb in `logging.report_to` hides wandb, the way Python marks
a module it could not import (`sys.modules[name] = None`): `importlib.util.find_spec` then reads it as absent, and
the libraries skip it. Only in a process that has not imported them yet: one that has (a test process running the
CLI in-process) keeps what it has. Imports no torch."""

from __future__ import annotations

import sys

from rlhf_cli import quantization, tracking

USERS = ("transformers", "trl", "peft")  # what imports the optional libraries when they are installed


def unused(run) -> list[str]:
    """The optional libraries the run (its typed settings, rlhf_cli.settings.of) does not use."""
    names = []
    if quantization.mode(run.get("model")) is None:
        names.append("bitsandbytes")
    if "wandb" not in tracking.report_to(run):
        names.append("wandb")
    return names


def hide_unused(run) -> None:
    """Hide what `unused` names, before the stage's imports, in a process that has not imported `USERS` yet."""
    if set(USERS) & sys.modules.keys():
        return
    for name in unused(run):
        if name not in sys.modules:
            sys.modules[name] = None
