"""What the trl-backed stages (sft, reward) share: trainer arguments from the config, data as HF datasets."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from rlhf_cli.launch import is_sharded, trainer_strategy_kwargs
from rlhf_cli.models import resolve_dtype

log = logging.getLogger("rlhf")


def train_dtype(cfg) -> tuple[torch.dtype, dict]:
    """(dtype to load weights in, mixed-precision trainer flags). fp16 trains from fp32 weights with autocast
    (fp16 master weights break gradient unscaling); bf16 loads and trains in bf16."""
    dtype = resolve_dtype(cfg.model.dtype, cfg.device.accelerator)
    if dtype == torch.float16:
        return torch.float32, {"fp16": True, "bf16": False}
    return dtype, {"fp16": False, "bf16": dtype == torch.bfloat16}


def trainer_kwargs(stage, cfg, out_dir: Path, precision: dict, n_train: int) -> dict:
    """TrainingArguments fields shared by SFTConfig and RewardConfig, filled from `cfg.<stage>` + `cfg.device`
    (device=zero2/zero3: a DeepSpeed config whose "auto" fields the trainer fills; device=fsdp:
    fsdp_config)."""
    # TensorBoard events land inside the stage directory (moved into place with it on success).
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out_dir / "tensorboard")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps_per_epoch = math.ceil(n_train / (stage.per_device_train_batch_size * stage.gradient_accumulation_steps * world))
    log.info("%s: %d rows, %d optimizer steps per epoch (%d per device × %d accumulation × %d process(es))",
             cfg.command, n_train, steps_per_epoch, stage.per_device_train_batch_size,
             stage.gradient_accumulation_steps, world)
    return dict(
        output_dir=str(out_dir),
        use_cpu=cfg.device.accelerator == "cpu",
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
        eval_strategy="steps",
        eval_steps=int(stage.eval_steps),
        save_strategy="no",
        report_to=["tensorboard"],
        max_length=int(stage.max_length),
        activation_checkpointing=bool(stage.activation_checkpointing),
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        seed=int(cfg.seed),
        data_seed=int(cfg.seed),
        **trainer_strategy_kwargs(cfg.device),
    )


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
