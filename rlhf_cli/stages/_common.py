"""What the trl-backed stages (sft, reward, dpo) share: precision, trainer arguments from the config, the console
(a progress bar with the metrics as lines), the guard on non-finite values, and saving. Their checkpoints and
resume: rlhf_cli.stages._checkpoints and rlhf_cli.resume (names kept importable from here)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rlhf_cli import devices, gpu_memory
from rlhf_cli.errors import RlhfError
from rlhf_cli.hardware import resolve_precision
from rlhf_cli.launch import is_sharded, trainer_strategy_kwargs
from rlhf_cli.models import fp32_trainables
from rlhf_cli.resume import latest_checkpoint, partial_dir, resume_hint, run_config  # noqa: F401 - the stages' names
from rlhf_cli.stages._checkpoints import Checkpoints, resume_unsafe_reason, safe_loading  # noqa: F401
from rlhf_cli.tracking import trainer_report_to

log = logging.getLogger("rlhf")


# ------------------------------------------------------------------------------------------------ precision
def training_precision(run, adapters: bool = False) -> tuple[torch.dtype, dict]:
    """(dtype to load the model in, the trainer's mixed-precision flags) of the run's settings (`run`:
    rlhf_cli.settings.of, or the composed config).

    Trainable weights keep fp32 master weights and optimizer state: bf16 weights trained in bf16 round small
    updates away (one AdamW step at lr 1e-5 moves an element by ~1e-5, below bf16's spacing near 1, so norm
    weights never change). A full fine-tune therefore loads fp32 and runs forward/backward under autocast at
    the compute dtype (`device.mixed_precision`); with adapters (LoRA) only the frozen base is stored in
    `model.dtype`, and peft keeps the adapters in fp32."""
    storage, compute = resolve_precision(run)
    load = storage if adapters else torch.float32
    return load, {"bf16": compute == torch.bfloat16, "fp16": compute == torch.float16}


def qlora_adapters(model) -> None:
    """trl casts the adapters of a quantized model to bf16 (the QLoRA paper's setting); they train as every
    trainable weight does here, in fp32 (bf16 rounds small AdamW updates away, and a CPU without bf16 units
    runs it far slower). peft's prepare_model_for_kbit_training is not called: in peft 0.21 it upcasts every
    unquantized frozen weight (embeddings, LM head, norms) to fp32 and turns activation checkpointing on; the
    norms already compute in fp32 (Qwen3's RMSNorm), and `<stage>.activation_checkpointing` decides the rest."""
    fp32_trainables(model)


def trainer_kwargs(stage, run, work_dir: Path, precision: dict, n_train: int) -> dict:
    """TrainingArguments fields shared by SFTConfig, RewardConfig and DPOConfig, filled from the stage's settings
    (`stage`: `run.sft`, `run.reward` or `run.dpo`) and the run's (`run`: rlhf_cli.settings.of; device=zero2/zero3:
    a DeepSpeed config whose "auto" fields the trainer fills; device=fsdp: fsdp_config). The trainer writes its
    checkpoints (every `save_steps`, the newest `save_total_limit` kept) and TensorBoard events into `work_dir`,
    the run's `partial_dir`, which outlives an interruption."""
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(work_dir / "tensorboard")
    save_steps, limit = int(stage.save_steps), stage.save_total_limit
    unsafe = resume_unsafe_reason(run.device)
    if unsafe and save_steps > 0:
        log.info("%s: no checkpoints with device.strategy=%s (%s)", run.command, run.device.strategy, unsafe)
        save_steps = 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps_per_epoch = math.ceil(n_train / (stage.per_device_train_batch_size * stage.gradient_accumulation_steps
                                           * world))
    log.info("%s: %d rows, %d optimizer steps per epoch (%d per device × %d accumulation × %d process(es))",
             run.command, n_train, steps_per_epoch, stage.per_device_train_batch_size,
             stage.gradient_accumulation_steps, world)
    return dict(
        output_dir=str(work_dir),
        use_cpu=run.device.accelerator == "cpu",
        **precision,
        learning_rate=float(stage.learning_rate),
        num_train_epochs=float(stage.num_train_epochs),
        max_steps=int(stage.max_steps),
        per_device_train_batch_size=int(stage.per_device_train_batch_size),
        per_device_eval_batch_size=int(stage.per_device_eval_batch_size),
        gradient_accumulation_steps=int(stage.gradient_accumulation_steps),
        lr_scheduler_type=str(stage.lr_scheduler_type),
        warmup_steps=float(stage.warmup_ratio),
        weight_decay=float(stage.weight_decay),
        max_grad_norm=float(stage.max_grad_norm),
        logging_steps=int(stage.logging_steps),
        # the trainer would replace a nan/inf step loss by the window's mean (and drop it from the eval loss);
        # the guard below wants to see it
        logging_nan_inf_filter=False,
        # metrics and progress go through `training_console`, not the trainer's printer
        disable_tqdm=True,
        eval_strategy="steps",
        eval_steps=int(stage.eval_steps),
        save_strategy="steps" if save_steps > 0 else "no",
        save_steps=max(save_steps, 1),
        save_total_limit=int(limit) if limit is not None else None,
        save_only_model=False,  # optimizer, scheduler and RNG state too: a resumed run ends where a whole one does
        report_to=trainer_report_to(run),  # logging.report_to: TensorBoard, wandb
        max_length=int(stage.max_length),
        activation_checkpointing=bool(stage.activation_checkpointing),
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        seed=int(run.seed),
        data_seed=int(run.seed),
        **trainer_strategy_kwargs(run.device),
    )


def preference_rows(data, tok, thinking: bool) -> tuple[list[dict], list[dict]]:
    """The training and eval pairs of `data` (the run's `data.*` settings) as the reward and DPO trainers take them
    (`data.pair_rows`): rows without a rejected answer refused, ties and prompts over data.max_prompt_length
    dropped and counted; `thinking`: model.enable_thinking."""
    from rlhf_cli import data as D

    templ, max_prompt = bool(data.chat_template), int(data.max_prompt_length)
    train, evals = D.load_examples(data, need_rejected=True)
    train = D.filter_long_prompts(train, tok, max_prompt, str(data.train_path), thinking, templ)
    evals = D.filter_long_prompts(evals, tok, max_prompt, "eval split", thinking, templ)
    return D.pair_rows(train, tok, thinking, templ), D.pair_rows(evals, tok, thinking, templ)


def require_examples(stage: str, kind: str, kept: int, given: int, max_length: int, max_prompt_length: int) -> None:
    """`kept` of `given` examples survived the trainer's length handling (sft drops examples whose prompt fills
    `max_length`, reward drops pairs longer than it): a warning for some, a one-line error for all."""
    if not given or kept == given:
        return
    if kept == 0:
        raise RlhfError(f"{stage}.max_length={max_length} tokens leaves no {kind} example to train on "
                        f"(all {given} are longer); raise {stage}.max_length above the prompt length "
                        f"(up to data.max_prompt_length={max_prompt_length} tokens) plus the answer")
    log.warning("%s: dropped %d of %d %s examples longer than %s.max_length=%d tokens",
                stage, given - kept, given, kind, stage, max_length)


# -------------------------------------------------------------------------------------------------- console
_QUIET_SUFFIXES = ("_runtime", "_per_second", "model_preparation_time", "num_tokens")


def metrics_line(stage: str, logs: dict, step: int, max_steps: int, elapsed: float, steps_done: int) -> str | None:
    """One readable line for a trainer log dict: the step, progress and ETA (from `steps_done` optimizer steps
    in `elapsed` seconds), then the metrics with 4 significant digits ("eval_" stripped from an eval's keys).
    None for the end-of-training summary (the stage reports its own). Throughput and token counts are left to
    TensorBoard."""
    if "train_runtime" in logs:
        return None
    is_eval = any(k.startswith("eval_") for k in logs)
    parts = []
    for key, value in logs.items():
        if key in ("total_flos", "epoch") or key.endswith(_QUIET_SUFFIXES):
            continue
        name = key[len("eval_"):] if is_eval and key.startswith("eval_") else key
        parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
    if step <= 0 or max_steps <= 0:
        where = f"{stage} before training"
    else:
        from tqdm import tqdm

        eta = tqdm.format_interval(elapsed / steps_done * max(max_steps - step, 0)) if steps_done > 0 else "?"
        where = f"{stage} step {step}/{max_steps} ({100 * step // max_steps}%, {tqdm.format_interval(elapsed)}<{eta})"
    return f"{where}{' eval' if is_eval else ''}: {', '.join(parts)}"


def _training_progress_class():
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class TrainingProgress(TrainerCallback):
        """A tqdm bar over optimizer steps (ETA, latest loss) in a terminal, on the main process only; every
        log dict becomes one `metrics_line` through the logger, which writes above the bar and into the run's
        log file (where the bar is off, each line carries the progress and the ETA)."""

        def __init__(self, stage: str):
            self.stage = stage
            self.bar = self.eval_bar = None
            self.t0 = time.perf_counter()
            self.first_step = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0, self.first_step = time.perf_counter(), state.global_step
            if state.is_world_process_zero:
                # disable=None: off when stderr is not a terminal (redirected to a log)
                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.stage, unit="step",
                                dynamic_ncols=True, disable=None)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            if not state.is_world_process_zero:
                return
            if self.eval_bar is None:
                total = (len(eval_dataloader) if eval_dataloader is not None and hasattr(eval_dataloader, "__len__")
                         else None)
                self.eval_bar = tqdm(total=total, desc=f"{self.stage} eval", unit="batch", leave=False,
                                     dynamic_ncols=True, disable=None)
            self.eval_bar.update(1)

        def on_evaluate(self, args, state, control, **kwargs):
            self._close_eval_bar()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            if any(k.startswith("eval_") for k in logs):
                self._close_eval_bar()  # the trainer logs an eval before `on_evaluate`
            line = metrics_line(self.stage, logs, state.global_step, state.max_steps, time.perf_counter() - self.t0,
                                state.global_step - self.first_step)
            if line is not None:
                log.info("%s", line)
            if self.bar is not None and "loss" in logs:
                self.bar.set_postfix(loss=f"{logs['loss']:.4g}", refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            self.close()

        def _close_eval_bar(self):
            if self.eval_bar is not None:
                self.eval_bar.close()
                self.eval_bar = None

        def close(self):
            self._close_eval_bar()
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return TrainingProgress


def _all_processes(ok: bool) -> bool:
    """True when `ok` holds on every process: all of them stop at the same step, none is left waiting in a
    collective. One all-reduce of a flag in a multi-process run."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return bool(ok)
    on_gpu = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()  # NCCL takes GPU tensors only
    flag = torch.tensor(int(bool(ok)), device=devices.resolve("cuda") if on_gpu else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def non_finite_error(stage: str, what: str, value, step: int, learning_rate: float) -> RlhfError:
    if step <= 0:
        return RlhfError(f"{stage}: {what} is {value} before training; the starting model gives non-finite "
                         f"outputs — check the model files, or compute in fp32 (device.mixed_precision=no)")
    return RlhfError(f"{stage}: {what} is {value} at step {step}; the learning rate is likely too high — lower "
                     f"{stage}.learning_rate (now {learning_rate:g})")


def _finite_guard_class():
    from transformers import TrainerCallback

    class FiniteGuard(TrainerCallback):
        """Stops at the first non-finite training loss (checked after every optimizer step, one scalar),
        logged grad_norm, or eval loss, with an RlhfError that names the step and the learning rate."""

        def __init__(self, trainer, stage: str, learning_rate: float):
            self.trainer, self.stage, self.lr = trainer, stage, learning_rate

        def on_step_end(self, args, state, control, **kwargs):
            # the trainer's running sum of this logging window's step losses: one nan/inf step makes it
            # non-finite until the next log (logging_nan_inf_filter=False keeps it there)
            window = getattr(self.trainer, "_tr_loss", None)
            if not isinstance(window, torch.Tensor):
                return
            here = bool(torch.isfinite(window).all())
            if not _all_processes(here):
                value = "not finite on another process" if here else window.item()
                raise non_finite_error(self.stage, "loss", value, state.global_step, self.lr)

        def on_log(self, args, state, control, logs=None, **kwargs):
            checked = ["loss", "eval_loss"]
            if not args.fp16:  # fp16's loss scaler expects inf gradients now and then and skips those steps
                checked.append("grad_norm")
            for key in checked:
                value = (logs or {}).get(key)
                if isinstance(value, (int, float)) and not math.isfinite(value):
                    what = "eval loss" if key == "eval_loss" else key
                    raise non_finite_error(self.stage, what, value, state.global_step, self.lr)

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            value = (metrics or {}).get("eval_loss")
            if isinstance(value, (int, float)) and not math.isfinite(value):
                raise non_finite_error(self.stage, "eval loss", value, state.global_step, self.lr)

    return FiniteGuard


@contextlib.contextmanager
def training_console(trainer, stage: str, learning_rate: float) -> Iterator[None]:
    """Within the block: the trainer's own printer (a raw dict per log, or its bar) is replaced by a progress
    bar with metric lines, logging writes through tqdm (so lines never break the bar), and non-finite values
    stop the run with an RlhfError. The bar is closed however the block ends."""
    from tqdm.contrib.logging import logging_redirect_tqdm
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    progress = _training_progress_class()(stage)
    trainer.add_callback(progress)
    trainer.add_callback(_finite_guard_class()(trainer, stage, learning_rate))
    gpu_memory.add_first(trainer, gpu_memory.trainer_callback())  # per-log GPU peaks, written with the log
    try:
        with logging_redirect_tqdm():
            yield
    finally:
        progress.close()


def require_finite(stage: str, values: dict, what: str, learning_rate: float, step: int) -> None:
    """Every float in `values` (metrics, score statistics) is finite, else an RlhfError naming the first."""
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise non_finite_error(stage, f"{what} {key}", value, step, learning_rate)


def require_finite_weights(model, stage: str, learning_rate: float, step: int) -> None:
    """The trainable weights (this process's shard of them, when sharded) are finite, before anything is
    saved."""
    def local(p):  # this process's part, without a collective per weight: FSDP2 DTensor, ZeRO-3 partition
        if hasattr(p, "ds_tensor"):
            return p.ds_tensor
        return p.to_local() if hasattr(p, "to_local") else p

    bad = next((n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(local(p)).all()),
               None)
    if not _all_processes(bad is None):
        raise non_finite_error(stage, f"trained weight {bad or '(on another process)'}", "not finite", step,
                               learning_rate)


def final_eval(trainer) -> dict:
    """The eval metrics of the trained model. The trainer already evaluates after its last step
    (eval_strategy="steps"), so those are reused instead of running the eval set a second time."""
    step = trainer.state.global_step
    for entry in reversed(trainer.state.log_history):
        if entry.get("step") != step:
            break
        if "eval_loss" in entry:
            return {k: v for k, v in entry.items() if k.startswith("eval_")}
    return trainer.evaluate()


# ---------------------------------------------------------------------------------------------------- save
def save_trained(trainer, model, tok, out: Path, device) -> None:
    """Write the trained model and tokenizer as a plain directory. Every process calls this: with sharded
    weights (ZeRO-3, FSDP) `trainer.save_model` gathers them (a collective) and the main process writes;
    otherwise the main process saves `model` (a LoRA adapter already merged) by itself."""
    if is_sharded(device):
        trainer.save_model(str(out))
    elif trainer.is_world_process_zero():
        model.save_pretrained(str(out))
    if trainer.is_world_process_zero():
        tok.save_pretrained(str(out))
