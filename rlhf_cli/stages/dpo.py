"""`rlhf dpo`: direct preference optimisation with trl's DPOTrainer, on the preference pairs `rlhf reward` reads.

DPO (Rafailov et al. 2023) trains the policy on the pairs directly, with no reward model and no sampling:
loss = -log σ(β [(log π(y_w|x) - log π_ref(y_w|x)) - (log π(y_l|x) - log π_ref(y_l|x))]) (`dpo.loss_type=sigmoid`);
trl's other pair losses (ipo, robust, hinge, ...) replace the outer function, and `dpo.rpo_alpha` adds RPO's NLL
of the chosen answers (trl's "sft" loss term). Every loss is trl's.

The policy starts from the SFT model (`dpo.policy_dir`). With LoRA (`dpo.lora.enabled`) trl wraps it and the
reference is the same model with the adapter disabled, so there is one copy of the weights, stored in
`model.dtype` (its decoder layers quantized with `model.quantization`: QLoRA), and fp32 adapters; a full
fine-tune trains fp32 weights against a frozen reference copy stored in `model.dtype`. The pairs are rendered as
in the reward stage: the prompt as every stage renders it, the answer and EOS, which is exactly what a policy
samples (`preference_rows`).

Writes `dpo.output_dir`: with LoRA the adapter (its base, the SFT model, recorded relative to the run as for
PPO's) and the tokenizer, else a plain model directory; metrics.json (held-out preference accuracy and margin of
the implicit reward β·log π/π_ref), TensorBoard events. `rlhf eval` takes it as a policy (`eval.policies.dpo`),
`rlhf chat` as `chat.model_dir`. A non-finite loss, gradient norm, eval metric or weight stops the run and
writes nothing. Checkpoints (every `dpo.save_steps`) live in the hidden sibling `.<name>.partial` until the output
is published; `dpo.resume=true` continues an interrupted run from the latest.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from rlhf_cli import gpu_memory, settings
from rlhf_cli.cards import write_card
from rlhf_cli.config import require_dir
from rlhf_cli.errors import RlhfError
from rlhf_cli.hardware import resolve_precision, setup_torch
from rlhf_cli.io import atomic_dir, write_json
from rlhf_cli.launch import is_sharded
from rlhf_cli.models import load_causal_lm, load_tokenizer, lora_config, quantization_config
from rlhf_cli.resume import run_shape
from rlhf_cli.stages._common import (
    Checkpoints,
    final_eval,
    preference_rows,
    qlora_adapters,
    require_examples,
    require_finite,
    require_finite_weights,
    save_trained,
    trainer_kwargs,
    training_console,
    training_precision,
)

log = logging.getLogger("rlhf")


def check_settings(run) -> Path:
    """What can be refused before any model or output directory is made (`run`: rlhf_cli.settings.of, or the
    composed config); returns the SFT model's directory."""
    d = run.dpo
    lora = d.lora
    targets = [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules)
    if bool(lora.enabled) and "lm_head" in targets:
        raise RlhfError("dpo.lora.target_modules names lm_head, which DPO cannot train (trl computes the "
                        "log-probabilities from the output layer's weight directly, so an adapter there would stay "
                        "at zero); leave lm_head out (all-linear does), or train every weight with "
                        "dpo.lora.enabled=false")
    if str(d.loss_type) == "exo_pair" and not float(d.label_smoothing) > 0:
        raise RlhfError("dpo.loss_type=exo_pair needs dpo.label_smoothing > 0 (its ε; the EXO paper uses 1e-3)")
    return require_dir(d.policy_dir, "SFT model (dpo.policy_dir)", "rlhf sft", marker="config.json")


def loss_settings(d) -> dict:
    """DPOConfig's loss fields: the pair loss, and RPO's NLL term on the chosen answers (trl's "sft" loss)
    weighted by `dpo.rpo_alpha`."""
    losses, weights = [str(d.loss_type)], [1.0]
    if d.rpo_alpha:
        losses.append("sft")
        weights.append(float(d.rpo_alpha))
    return {"loss_type": losses, "loss_weights": weights, "beta": float(d.beta),
            "label_smoothing": float(d.label_smoothing)}


def build_trainer(run, policy_dir: Path, work: Path):
    """The stage's DPOTrainer writing its checkpoints and TensorBoard events into `work`, not yet trained, and
    (training pairs, eval pairs) as trl kept them, from the run's settings (`run`: rlhf_cli.settings.of)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    d = run.dpo
    tok = load_tokenizer(policy_dir, run.model)
    max_prompt = int(run.data.max_prompt_length)
    train_rows, eval_rows = preference_rows(run.data, tok, bool(run.model.enable_thinking))

    lora = bool(d.lora.enabled)
    dtype, precision = training_precision(run, adapters=lora)
    quant = quantization_config(run) if lora else None  # rlhf_cli.quantization refused a quantized full fine-tune
    model = load_causal_lm(policy_dir, dtype, run.model, quant)
    reference = None
    if not lora:  # trl would load the reference itself, in the policy's fp32; a frozen copy needs only model.dtype
        reference = load_causal_lm(policy_dir, resolve_precision(run)[0], run.model).eval().requires_grad_(False)
    args = DPOConfig(**trainer_kwargs(d, run, work, precision, len(train_rows)), **loss_settings(d),
                     disable_dropout=True, dataset_num_proc=None)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(train_rows),
                         eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None, processing_class=tok,
                         peft_config=lora_config(d.lora, "CAUSAL_LM", model, "dpo.lora") if lora else None)
    if quant is not None:
        qlora_adapters(trainer.model)
    # trl drops pairs whose prompt fills max_length (no answer token left to compare)
    for kind, rows, ds in (("training", train_rows, trainer.train_dataset),
                           ("eval", eval_rows, trainer.eval_dataset)):
        require_examples("dpo", kind, len(ds) if ds is not None else 0, len(rows), int(d.max_length), max_prompt)
    return trainer, len(trainer.train_dataset), len(trainer.eval_dataset) if eval_rows else 0


def save_policy(trainer, out: Path, device) -> None:
    """The adapter, its base recorded relative to the run (as PPO's: a moved run still loads), or the full model;
    and the tokenizer (`device`: the run's device settings). Every process calls this (sharded weights are
    gathered collectively)."""
    model, tok = trainer.model, trainer.processing_class
    if not hasattr(model, "peft_config"):
        save_trained(trainer, model, tok, out, device)
        return
    if is_sharded(device):
        trainer.save_model(str(out))  # gathers the adapter; peft records the base by its absolute path
    elif trainer.is_world_process_zero():
        from rlhf_cli.ppo.checkpoint import save_model

        save_model(model, out)
    if trainer.is_world_process_zero():
        tok.save_pretrained(str(out))


def run(cfg) -> None:
    typed = settings.of(cfg)  # what the stage reads; the composed config itself is only recorded (resume, card)
    d = typed.dpo
    policy_dir = check_settings(typed)
    setup_torch(typed)
    lr = d.learning_rate
    inputs = [d.policy_dir, typed.model.name_or_path, typed.model.tiny.dir]  # never replaced by the output
    with (atomic_dir(d.output_dir, "dpo", inputs) as out,
          Checkpoints.start(typed, "dpo", run_shape(cfg, "dpo")) as ckpt):
        trainer, n_train, n_eval = build_trainer(typed, policy_dir, ckpt.work)
        with training_console(trainer, "dpo", lr):
            t0 = time.perf_counter()
            result = ckpt.train(trainer)
            seconds = time.perf_counter() - t0
            ev = final_eval(trainer) if n_eval else {}
        step = result.global_step
        require_finite("dpo", ev, "metric", lr, step)
        require_finite_weights(trainer.model, "dpo", lr, step)
        save_policy(trainer, out, typed.device)
        if trainer.is_world_process_zero():
            # train_loss and train_seconds cover the steps of this call (those after `resumed_from`)
            metrics = {"eval_accuracy": ev.get("eval_rewards/accuracies"),
                       "eval_margin": ev.get("eval_rewards/margins"), "eval_loss": ev.get("eval_loss"),
                       "train_loss": result.training_loss, "steps": step,
                       "train_pairs": n_train, "eval_pairs": n_eval, "train_seconds": round(seconds, 2),
                       "policy_dir": str(policy_dir), "lora": d.lora.enabled, "loss_type": d.loss_type,
                       "beta": d.beta, "rpo_alpha": d.rpo_alpha, "resumed_from": ckpt.resumed_step,
                       **gpu_memory.run_peaks(trainer)}  # GPU peaks (none off CUDA)
            write_json(out / "metrics.json", metrics)
            write_card(out, cfg, "dpo")
            ckpt.finish(out)
    ckpt.drop()
    acc, margin = ev.get("eval_rewards/accuracies"), ev.get("eval_rewards/margins")
    msg = (f"dpo: held-out preference accuracy {acc:.3f}, margin {margin:.2f} on {n_eval} pairs"
           if acc is not None and not math.isnan(acc) else "dpo: no eval split")
    log.info("%s; %d steps in %.1f s; wrote %s", msg, step, seconds, d.output_dir)
    print(msg)
