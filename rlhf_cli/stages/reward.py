"""`rlhf reward`: a Bradley-Terry reward model with trl's RewardTrainer, loss = -log σ(r_chosen - r_rejected).

The model is `AutoModelForSequenceClassification(num_labels=1)` initialised from the SFT output. It is trained
on exactly the token sequences PPO will score: the rendered prompt (chat template + assistant header) followed
by the answer and EOS, so the score is read at the EOS token in both places.

Writes `reward.output_dir`: the model (fp32) + tokenizer, score_stats.json (mean/std of its scores over training
answers, for PPO's score normalisation), metrics.json (held-out accuracy and margin), TensorBoard events. A
non-finite loss, gradient norm, eval metric, weight or score statistic stops the run and writes nothing.
Checkpoints (every `reward.save_steps`) live in the hidden sibling `.<name>.partial` until the output is
published; `reward.resume=true` continues an interrupted run from the latest.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from rlhf_cli import devices, gpu_memory, quantization, settings
from rlhf_cli.cards import write_card
from rlhf_cli.config import require_dir
from rlhf_cli.hardware import resolve_precision, setup_torch
from rlhf_cli.io import atomic_dir, write_json
from rlhf_cli.learned import reward_warning
from rlhf_cli.models import load_seq_cls, load_tokenizer
from rlhf_cli.resume import run_shape
from rlhf_cli.sources import base_model_dir
from rlhf_cli.stages._common import (
    Checkpoints,
    final_eval,
    preference_rows,
    require_examples,
    require_finite,
    require_finite_weights,
    save_trained,
    trainer_kwargs,
    training_console,
    training_precision,
)

log = logging.getLogger("rlhf")


@torch.no_grad()
def score_texts(model, tok, texts: list[str], batch_size: int = 64, compute: torch.dtype | None = None) -> torch.Tensor:
    """Reward-model scores (N,) of full texts (prompt + answer + EOS), left-padded in batches, computed at the
    run's compute dtype (`compute`, None: fp32) as training and PPO compute them."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i: i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with devices.autocast(device, compute):
            out.append(model(**enc, position_ids=pos).logits[:, 0].float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


def build_trainer(run, work: Path):
    """The stage's RewardTrainer writing its checkpoints and TensorBoard events into `work`, not yet trained,
    and (init model dir, train pairs, eval pairs), from the run's settings (`run`: rlhf_cli.settings.of, or the
    composed config). Every weight is trained, so it loads in fp32 and computes under autocast
    (`training_precision`)."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    r = run.reward
    if str(r.init_from) == "base":
        init = base_model_dir(run)
    else:
        init = require_dir(r.init_from, "SFT model (reward.init_from)", "rlhf sft", marker="config.json")
    tok = load_tokenizer(init, run.model)
    max_prompt = int(run.data.max_prompt_length)
    train_rows, eval_rows = preference_rows(run.data, tok, bool(run.model.enable_thinking))

    dtype, precision = training_precision(run)
    if quantization.mode(run.model):
        log.info("reward: every weight trains, in fp32: model.quantization=%s applies where the reward model is "
                 "frozen (rlhf ppo, rlhf eval)", run.model.quantization)
    model = load_seq_cls(init, tok, dtype, run.model)
    args = RewardConfig(**trainer_kwargs(r, run, work, precision, len(train_rows)),
                        center_rewards_coefficient=r.center_rewards_coefficient, disable_dropout=True)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(train_rows),
                            eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
                            processing_class=tok)
    # trl drops pairs longer than max_length
    for kind, rows, ds in (("training", train_rows, trainer.train_dataset), ("eval", eval_rows, trainer.eval_dataset)):
        require_examples("reward", kind, len(ds) if ds is not None else 0, len(rows), int(r.max_length), max_prompt)
    return trainer, init, train_rows, len(trainer.eval_dataset) if eval_rows else 0


def run(cfg) -> None:
    typed = settings.of(cfg)  # what the stage reads; the composed config itself is only recorded (resume, card)
    setup_torch(typed)
    r = typed.reward
    lr = r.learning_rate
    inputs = [r.init_from, typed.model.name_or_path, typed.model.tiny.dir]  # never replaced by the output
    with (atomic_dir(r.output_dir, "reward", inputs) as out,
          Checkpoints.start(typed, "reward", run_shape(cfg, "reward")) as ckpt):
        trainer, init, train_rows, n_eval = build_trainer(typed, ckpt.work)
        tok = trainer.processing_class
        with training_console(trainer, "reward", lr):
            t0 = time.perf_counter()
            result = ckpt.train(trainer)
            seconds = time.perf_counter() - t0
            ev = final_eval(trainer) if n_eval else {}
        step = result.global_step
        require_finite("reward", ev, "metric", lr, step)
        model = trainer.model
        require_finite_weights(model, "reward", lr, step)
        # Score statistics over training answers (both sides), for PPO's (score - mean) / std. Every process
        # scores the same texts: with sharded weights (ZeRO-3, FSDP) each forward pass is a collective.
        sample = train_rows[:1024]
        texts = [row["prompt"] + ans + tok.eos_token for row in sample for ans in (row["chosen"], row["rejected"])]
        scores = score_texts(model, tok, texts, r.per_device_eval_batch_size, resolve_precision(typed)[1])
        stats = {"mean": scores.mean().item(), "std": max(scores.std().item(), 1e-6), "n": len(texts)}
        require_finite("reward", stats, "score", lr, step)
        save_trained(trainer, model, tok, out, typed.device)
        if trainer.is_world_process_zero():
            write_json(out / "score_stats.json", stats)
            # train_loss and train_seconds cover the steps of this call (those after `resumed_from`)
            metrics = {"eval_accuracy": ev.get("eval_accuracy"), "eval_margin": ev.get("eval_margin"),
                       "eval_loss": ev.get("eval_loss"), "train_loss": result.training_loss,
                       "steps": step, "train_pairs": len(trainer.train_dataset),
                       "eval_pairs": n_eval, "train_seconds": round(seconds, 2), "init_from": str(init),
                       "score_mean": stats["mean"], "score_std": stats["std"], "resumed_from": ckpt.resumed_step,
                       **gpu_memory.run_peaks(trainer)}  # GPU peaks (none off CUDA)
            write_json(out / "metrics.json", metrics)
            write_card(out, cfg, "reward")
            ckpt.finish(out)
    ckpt.drop()
    acc, margin = ev.get("eval_accuracy"), ev.get("eval_margin")
    msg = (f"reward: held-out accuracy {acc:.3f}, margin {margin:.2f} on {n_eval} pairs"
           if acc is not None and not math.isnan(acc) else "reward: no eval split")
    log.info("%s; %d steps in %.1f s; wrote %s", msg, step, seconds, r.output_dir)
    print(msg)
    warning = reward_warning({"eval_accuracy": acc})
    if warning:
        log.warning(warning)
