"""`rlhf sft`: supervised fine-tuning with trl's SFTTrainer, loss on the answer tokens only.

Writes `sft.output_dir`: a plain `AutoModelForCausalLM` directory in fp32 (the trained master weights; a LoRA
adapter, if trained, is merged) with the tokenizer, TensorBoard events under tensorboard/, and metrics.json (eval
loss before and after). A non-finite loss, gradient norm, eval loss or weight stops the run and writes nothing.
Checkpoints (every `sft.save_steps`) live in the hidden sibling `.<name>.partial` until the output is published;
`sft.resume=true` continues an interrupted run from the latest.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from rlhf_cli import data as D
from rlhf_cli import gpu_memory, quantization, settings
from rlhf_cli.cards import write_card
from rlhf_cli.hardware import setup_torch
from rlhf_cli.io import atomic_dir, write_json
from rlhf_cli.learned import sft_warning
from rlhf_cli.models import (
    load_causal_lm,
    load_tokenizer,
    lora_config,
    merge_lora,
    merge_unquantized,
    quantization_config,
)
from rlhf_cli.own_data import sft_floor, steps_per_epoch
from rlhf_cli.resume import run_shape
from rlhf_cli.sources import base_model_dir
from rlhf_cli.stages._common import (
    Checkpoints,
    final_eval,
    qlora_adapters,
    require_examples,
    require_finite_weights,
    save_trained,
    trainer_kwargs,
    training_console,
    training_precision,
)
from rlhf_cli.stages._sampling import answer_check

log = logging.getLogger("rlhf")


def sft_rows(examples: list[D.Example], on_rejected: bool, enable_thinking: bool, tok=None,
             chat_template: bool = True) -> list[dict]:
    """Prompt/completion rows: trl masks the prompt, so the loss is on the answer only. Conversational (trl
    applies the chat template) or, with `data.chat_template=false`, plain text ending in EOS."""
    rows = []
    for ex in examples:
        answers = [ex.chosen] + ([ex.rejected] if on_rejected and ex.rejected else [])
        for a in answers:
            if chat_template:
                rows.append({"prompt": ex.prompt, "completion": [{"role": "assistant", "content": a}],
                             "chat_template_kwargs": {"enable_thinking": enable_thinking}})
            else:
                rows.append({"prompt": D.prompt_text(tok, ex.prompt, chat_template=False),
                             "completion": a + tok.eos_token})
    return rows


def build_trainer(run, work: Path):
    """The stage's SFTTrainer writing its checkpoints and TensorBoard events into `work`, not yet trained, and
    (base model dir, train rows, eval rows), from the run's settings (`run`: rlhf_cli.settings.of, or the
    composed config).

    Weights: a full fine-tune trains fp32 weights under autocast; with LoRA the frozen base is stored in
    `model.dtype` (its decoder layers quantized with `model.quantization`: QLoRA) and the adapters in fp32
    (`training_precision`)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    s, data = run.sft, run.data
    base = base_model_dir(run)
    tok = load_tokenizer(base, run.model)
    thinking = bool(run.model.enable_thinking)
    templ, on_rejected = bool(data.chat_template), bool(data.sft_on_rejected)
    max_prompt = int(data.max_prompt_length)
    train, evals = D.load_examples(data, need_rejected=on_rejected)
    train = D.filter_long_prompts(train, tok, max_prompt, str(data.train_path), thinking, templ)
    evals = D.filter_long_prompts(evals, tok, max_prompt, "eval split", thinking, templ)
    train_rows = sft_rows(train, on_rejected, thinking, tok, templ)
    eval_rows = sft_rows(evals, on_rejected, thinking, tok, templ)

    lora = bool(s.lora.enabled)
    dtype, precision = training_precision(run, adapters=lora)
    quant = quantization_config(run) if lora else None  # rlhf_cli.quantization refused a quantized full fine-tune
    model = load_causal_lm(base, dtype, run.model, quant)
    kw = trainer_kwargs(s, run, work, precision, len(train_rows))
    kw["num_train_epochs"] = sft_floor(run, steps_per_epoch(len(train_rows), kw)) or kw["num_train_epochs"]
    args = SFTConfig(**kw, completion_only_loss=True, packing=False, dataset_num_proc=None)
    peft = lora_config(s.lora, "CAUSAL_LM", model, "sft.lora") if lora else None
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(train_rows),
                         eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
                         processing_class=tok, peft_config=peft)
    if quant is not None:
        qlora_adapters(trainer.model)
    # trl drops examples whose prompt fills max_length (no answer token left to learn from)
    for kind, rows, ds in (("training", train_rows, trainer.train_dataset), ("eval", eval_rows, trainer.eval_dataset)):
        require_examples("sft", kind, len(ds) if ds is not None else 0, len(rows), int(s.max_length), max_prompt)
    return trainer, base, len(trainer.train_dataset), len(trainer.eval_dataset) if eval_rows else 0


def run(cfg) -> None:
    typed = settings.of(cfg)  # what the stage reads; the composed config itself is only recorded (resume, card)
    setup_torch(typed)
    s = typed.sft
    lr = s.learning_rate
    with (atomic_dir(s.output_dir, "sft", [typed.model.name_or_path, typed.model.tiny.dir]) as out,
          Checkpoints.start(typed, "sft", run_shape(cfg, "sft")) as ckpt):
        trainer, base, n_train, n_eval = build_trainer(typed, ckpt.work)
        tok = trainer.processing_class
        with training_console(trainer, "sft", lr):
            start = ckpt.remembered("eval_loss_start")  # a resumed run measured it before its first step
            if ckpt.resume_from is None:
                start = trainer.evaluate()["eval_loss"] if n_eval else None
                ckpt.remember(eval_loss_start=start)
            t0 = time.perf_counter()
            result = ckpt.train(trainer)
            seconds = time.perf_counter() - t0
            end = final_eval(trainer)["eval_loss"] if n_eval else None
        model = trainer.model
        require_finite_weights(model, "sft", lr, result.global_step)
        if s.lora.enabled and quantization.mode(typed.model):
            # QLoRA: merged into the base loaded unquantized in fp32 (rlhf_cli.models.merge_unquantized)
            model = merge_unquantized(model, base, torch.float32, typed.model)
        elif s.lora.enabled:
            # merged in fp32: a bf16 base would round the adapter's small changes away
            model = merge_lora(model.to(torch.float32))
        save_trained(trainer, model, tok, out, typed.device)
        answers = {}
        if trainer.is_world_process_zero():
            if trainer.args.world_size == 1:  # sharded weights would need every process to sample
                answers = answer_check(model, tok, typed)  # did it learn? (rlhf_cli.learned.sft_warning)
            # train_loss and train_seconds cover the steps of this call (those after `resumed_from`)
            metrics = {"eval_loss_start": start, "eval_loss_end": end, "train_loss": result.training_loss,
                       "steps": result.global_step, "train_rows": n_train, "eval_rows": n_eval,
                       "train_seconds": round(seconds, 2), "base_model": str(base),
                       "resumed_from": ckpt.resumed_step, **answers,
                       **gpu_memory.run_peaks(trainer)}  # GPU peaks (none off CUDA)
            write_json(out / "metrics.json", metrics)
            write_card(out, cfg, "sft")
            ckpt.finish(out)
    ckpt.drop()
    log.info("sft: eval loss %s -> %s in %d steps (%.1f s); wrote %s",
             f"{start:.3f}" if start is not None else "n/a", f"{end:.3f}" if end is not None else "n/a",
             result.global_step, seconds, s.output_dir)
    warning = sft_warning({**answers, "eval_loss_end": end, "steps": result.global_step})
    if warning:
        log.warning(warning)
