"""The run's log directory (`hydra.run.dir`, <run_dir>/logs/<command>) only where a command did something.

Hydra makes the directory, with its .hydra/ config copies and the log file, before the command runs. A command
that was refused (a bad value, a missing file, a check of the stage before it logged anything) or that writes
nothing (doctor, chat) would leave runs/<recipe>/logs/<command> behind, and in a new directory a whole
runs/<recipe>/. The callback `FreshLogs` (conf/config.yaml, hydra.callbacks) notes, before Hydra makes the directory, which of it and
its parents do not exist yet; `remove_unused()` removes those again: the log directory itself, then each new
parent that is left empty. A directory that was there before (an earlier run's logs) is never touched.
Torch-free; Hydra calls every hook by name, so all six are here, as in rlhf_cli.multirun.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# the log directory and its parents that did not exist before this run, deepest first
_created: list[Path] = []


class FreshLogs:
    def on_run_start(self, config, **kwargs) -> None:
        _created.clear()
        try:
            path = Path(str(config.hydra.run.dir)).absolute()
        except Exception:  # noqa: BLE001 - a dir that cannot be resolved here: Hydra reports it, nothing to note
            return
        while not path.exists() and path != path.parent:
            _created.append(path)
            path = path.parent

    def on_run_end(self, config, **kwargs) -> None:
        pass

    def on_multirun_start(self, config, **kwargs) -> None:
        _created.clear()  # a sweep's job directories hold its summary: kept

    def on_multirun_end(self, config, **kwargs) -> None:
        pass

    def on_job_start(self, config, **kwargs) -> None:
        pass

    def on_job_end(self, config, job_return, **kwargs) -> None:
        pass


def remove_unused(only_if_silent: bool = False) -> None:
    """Remove the log directory this run made (with what Hydra put in it), then its new parents that are left
    empty; directories that existed before the run stay. `only_if_silent`: only when nothing was logged (every
    file beside Hydra's .hydra/ copies is empty)."""
    if not _created:
        return
    if only_if_silent and any(p.is_file() and p.stat().st_size for p in _created[0].rglob("*")
                              if ".hydra" not in p.relative_to(_created[0]).parts):
        _created.clear()  # decided once per run: kept
        return
    shutil.rmtree(_created[0], ignore_errors=True)
    for parent in _created[1:]:
        try:
            parent.rmdir()  # only when empty: a stage may have written beside the logs
        except OSError:
            break
    _created.clear()
