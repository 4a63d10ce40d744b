"""The checkpoints of the trl-backed stages (sft, reward, dpo): transformers' checkpoint-N/ in the run's partial
directory (rlhf_cli.resume), the run they resume, and loading them without pickle.

A trainer checkpoint-N/ holds model.safetensors (or the LoRA adapter's safetensors), optimizer.pt, scheduler.pt,
rng_state.pth and trainer_state.json. transformers 5 reads the .pt/.pth files with torch.load(weights_only=True):
tensors, plain containers and numpy's RNG state, nothing that runs code. `safe_loading` makes that a rule for the
whole resume, and training_args.bin (a pickled TrainingArguments, which resuming never reads) is not kept."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rlhf_cli import resume as R
from rlhf_cli.errors import RlhfError
from rlhf_cli.io import process_rank, read_json, write_json
from rlhf_cli.launch import strategy

log = logging.getLogger("rlhf")


def resume_unsafe_reason(device) -> str | None:
    """Why the trainer's checkpoints cannot be resumed without pickle on `device` (then none are written), or
    None. DeepSpeed reads its own checkpoint files with pickle; sharded FSDP state dicts go through
    torch.distributed.checkpoint, whose metadata file is a pickle. One process, DDP and FSDP with full state
    dicts read safetensors and torch.load(weights_only=True) files only."""
    s = strategy(device)
    if s == "deepspeed":
        return "DeepSpeed reads its checkpoints with pickle"
    if s == "fsdp" and str(device.fsdp.state_dict_type) != "FULL_STATE_DICT":
        return ("sharded FSDP checkpoints carry pickled metadata (device.fsdp.state_dict_type=FULL_STATE_DICT "
                "resumes)")
    return None


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """Within the block every torch.load is weights_only=True, whatever its caller asks for
    (TORCH_FORCE_WEIGHTS_ONLY_LOAD, which torch reads at each call): a file that needs pickle fails to load
    instead of running code."""
    keys = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {k: os.environ.pop(k, None) for k in keys}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _no_pickled_args_class():
    from transformers import TrainerCallback

    from rlhf_cli.ppo.checkpoint import write_checksums

    class NoPickledArgs(TrainerCallback):
        """Deletes training_args.bin (torch.save of the TrainingArguments object: loading it would unpickle
        arbitrary classes) from each checkpoint; a resumed run takes its arguments from the config. Then writes
        the checksums of the checkpoint's files (checked before it is resumed: `check_checkpoint`)."""

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                (ckpt / "training_args.bin").unlink(missing_ok=True)
                if ckpt.is_dir():
                    write_checksums(ckpt)

    return NoPickledArgs


def check_checkpoint(stage: str, ckpt: Path, model) -> None:
    """Everything `ckpt` holds, checked before the trainer loads any of it, each failure one line naming the file
    and what to do: every .pt / .pth file loads without pickle (the trainer's optimizer, scheduler and RNG
    state), every file matches its checksum, and the weights file holds exactly the keys and shapes of `model`
    (transformers would load a foreign file non-strictly and train on from the base weights)."""
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals

    from rlhf_cli.ppo import checkpoint as C

    fix = f"delete {ckpt} to resume from an earlier checkpoint, or start over with {stage}.fresh=true"
    for file in sorted([*ckpt.glob("*.pt"), *ckpt.glob("*.pth")]):
        try:
            with safe_loading(), safe_globals():  # numpy's RNG state, as the trainer allows it
                torch.serialization.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # torch's own message advises weights_only=False
            raise RlhfError(f"{stage}.resume=true: a file in {ckpt} holds pickled objects, which rlhf does not load "
                            f"(torch.load(weights_only=True) refused {file.name}); {fix}") from e
        except Exception as e:  # noqa: BLE001 - truncated or not a torch file: one line naming it
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise RlhfError(f"{stage}.resume=true: checkpoint file {file} is unreadable ({first}); {fix}") from e
    C.verify_checksums(ckpt)
    if C.weights_file(model, ckpt).is_file() or not (ckpt / "model.safetensors.index.json").is_file():
        C.read_weights(model, ckpt, ckpt)


class Checkpoints:
    """The checkpoints of one sft / reward / dpo run, in its partial directory (`work`), and the run it resumes.

    `start` is called inside the output's atomic_dir, whose run lock covers the partial directory too. As a
    context manager: a run that fails or is stopped before its first checkpoint leaves nothing behind; one with
    a checkpoint keeps it for `<stage>.resume=true`."""

    def __init__(self, stage: str, work: Path, resume_from: Path | None, token: str, shape: dict | None = None):
        self.stage, self.work, self.resume_from, self.token = stage, work, resume_from, token
        self.shape = shape  # the run's settings (R.run_shape), as its checkpoints record them
        self.main = process_rank()[0] == 0
        self._trainer = None  # the trainer `train` runs, whose writers a failed run closes before its folder goes

    @property
    def resumed_step(self) -> int | None:
        return int(self.resume_from.name.split("-", 1)[1]) if self.resume_from is not None else None

    @classmethod
    def start(cls, run, stage: str, shape: dict) -> Checkpoints:
        """Prepare the partial directory of `<stage>.output_dir` and find the checkpoint to resume from; `run`: the
        run's settings (rlhf_cli.settings.of), `shape`: the run's record its checkpoints keep (`resume.run_shape`
        of the composed config).

        `<stage>.resume=true`: the latest complete checkpoint, if the keys that shape the run are as they were
        (else a one-line error naming the changed keys). Otherwise a fresh run (`resume.refuse_interrupted`).
        Only the main process changes files; every process finds the same checkpoint."""
        import uuid

        s = run[stage]
        out = Path(s.output_dir)
        work = R.partial_dir(out)
        resume, fresh = bool(s.resume), bool(s.fresh)
        R.check_switches(stage, resume, fresh)
        found = R.latest_checkpoint(work)
        token = uuid.uuid4().hex
        main = process_rank()[0] == 0
        if resume:  # the run is taken over (run.json's "run") once its checkpoint is checked (`train`)
            cls._check_resume(run, stage, out, work, found, shape)
            return cls(stage, work, found, token, shape)
        R.refuse_interrupted(stage, work, found, fresh)
        if main:
            R.start_over(stage, work, found)
            write_json(work / R.RUN_FILE, {"run": token, "stage": stage, "config": shape})
        return cls(stage, work, None, token, shape)

    @staticmethod
    def _check_resume(run, stage: str, out: Path, work: Path, found: Path | None, shape: dict) -> None:
        unsafe = resume_unsafe_reason(run.device)
        if unsafe:
            raise RlhfError(f"{stage}.resume=true is not available with device.strategy={run.device.strategy}: "
                            f"{unsafe}, and rlhf loads nothing with pickle; drop {stage}.resume=true")
        if found is None:
            if not work.exists() and (out / "metrics.json").is_file():
                raise R.finished_refusal(stage, out)
            raise RlhfError(f"{stage}.resume=true but there is no checkpoint to resume at {work} (the run writes "
                            f"one every {stage}.save_steps={run[stage].save_steps} steps); drop "
                            f"{stage}.resume=true")
        try:
            stored = read_json(work / R.RUN_FILE)["config"]
            if not isinstance(stored, dict):
                raise TypeError("no mapping")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RlhfError(f"{stage}.resume=true: {work / R.RUN_FILE} is missing or unreadable "
                            f"({type(e).__name__}), so the run's settings cannot be checked; start over with "
                            f"{stage}.fresh=true") from e
        changed = R.changed_keys(stored, shape)
        if changed:
            k = changed[0]
            raise RlhfError(f"{stage}.resume=true: {k} was {R.show(stored.get(k, R.UNSET))} in the interrupted run "
                            f"and is {R.show(shape.get(k, R.UNSET))} now{R.also(changed, stored, shape)}; resume "
                            f"with the same value, or start over with {stage}.fresh=true")

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None and self.main and R.latest_checkpoint(self.work) is None:
            _close_writers(self._trainer)  # else TensorBoard's writer thread may write into it while it goes
            shutil.rmtree(self.work, ignore_errors=True)

    def remembered(self, key: str):
        """A value `remember`ed by the run this one resumes (None for a fresh run)."""
        if self.resume_from is None:
            return None
        with contextlib.suppress(OSError, ValueError, AttributeError):
            return read_json(self.work / R.RUN_FILE).get(key)
        return None

    def remember(self, **values) -> None:
        """Keep `values` with the checkpoints, for a resumed run (main process)."""
        if self.main:
            write_json(self.work / R.RUN_FILE, {**read_json(self.work / R.RUN_FILE), **values})

    def train(self, trainer):
        """`trainer.train()`, from the checkpoint when resuming (weights, optimizer, scheduler, RNG and the
        position in the data), with nothing loaded through pickle."""
        trainer.add_callback(_no_pickled_args_class()())
        self._trainer = trainer
        if self.resume_from is None:
            return trainer.train()
        import pickle

        log.info("%s: resuming from %s", self.stage, self.resume_from)
        check_checkpoint(self.stage, self.resume_from, trainer.accelerator.unwrap_model(trainer.model))
        self.remember(run=self.token)
        try:
            with safe_loading():
                return trainer.train(resume_from_checkpoint=str(self.resume_from))
        except pickle.UnpicklingError as e:  # torch's own message advises weights_only=False
            raise RlhfError(f"{self.stage}.resume=true: a file in {self.resume_from} holds pickled objects, which "
                            f"rlhf does not load (torch.load(weights_only=True) refused it); delete "
                            f"{self.resume_from} to resume from an earlier checkpoint, or start over with "
                            f"{self.stage}.fresh=true") from e

    def finish(self, out: Path) -> None:
        """Move the TensorBoard events (both parts of a resumed run) into the output being assembled, and add the
        digest of the run's settings to its metrics.json (`settings_sha256`: make chain-dpo keeps an SFT output
        finished with the settings it has, `R.finished_as_configured`). Main process, before it is published."""
        metrics = out / "metrics.json"
        if self.shape is not None and metrics.is_file():
            write_json(metrics, {**read_json(metrics), "settings_sha256": R.settings_digest(self.shape)})
        tb = self.work / "tensorboard"
        if tb.is_dir():
            shutil.rmtree(out / "tensorboard", ignore_errors=True)
            shutil.move(str(tb), str(out / "tensorboard"))

    def drop(self) -> None:
        """The output is published: delete the checkpoints (main process), unless another run has taken the
        partial directory over since the lock was released."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if self.main and read_json(self.work / R.RUN_FILE).get("run") == self.token:
                shutil.rmtree(self.work, ignore_errors=True)


def _close_writers(trainer) -> None:
    """Close the TensorBoard writers of `trainer`'s callbacks (transformers' TensorBoardCallback), flushing
    their events now rather than from their own thread later."""
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        writer = getattr(callback, "tb_writer", None)
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
