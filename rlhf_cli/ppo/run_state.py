"""What a PPO run saves and continues from: its run config (what shapes it, compared on resume), its checkpoint
(weights, optimizer, scheduler, KL controller, counters, RNG of every process) and the resume that puts all of it
back, on a `PPOTrainer` (whose `run_config` / `save` / `resume` call these). The checkpoint's files, their checks
and the comparison of run configs are rlhf_cli.ppo.checkpoint's; the stage's side of a resume (which checkpoint,
the partial directory, refusals) is rlhf_cli.resume's."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_cli.ppo import checkpoint, evaluation, shard

log = logging.getLogger("rlhf")

# PPOConfig fields that do not change what a run computes (how often it logs, samples, saves and evaluates, and a
# check of the first update): left out of its run config, so they may change on resume
NOT_SHAPING_FIELDS = ("logging_steps", "sample_every", "save_every", "save_total_limit", "eval_every", "keep_best",
                      "first_update_kl_tolerance")
# run-config keys of the KL controller: changed under ppo.resume=force, it restarts from the new kl_coef
KL_KEYS = ("ppo.kl_coef", "ppo.adaptive_kl", "ppo.adaptive_kl_target", "ppo.kl_horizon")


@dataclass
class Progress:
    update: int = 0        # updates done
    episodes: int = 0      # episodes done, over all processes
    metrics: dict = field(default_factory=dict)


def run_config(trainer) -> dict:
    """What shapes this run, by the config keys that set it: stored with each checkpoint and compared on resume
    (`checkpoint.compare_run_config`). Every `PPOConfig` field but those of NOT_SHAPING_FIELDS (how often it
    logs, samples, saves and evaluates), `run_record` (what the stage adds: data files, seed, the models'
    content identity: `rlhf_cli.resume.ppo_record`), and what the built run has: its schedule and batches
    (episodes are those trained, whole batches), LoRA, the value model, sources (directories recorded as
    adapters record their base, relative inside the run directory, so a moved run still resumes)."""
    c, sz = trainer.c, trainer.sizes
    lora = getattr(trainer.unwrapped, "peft_config", {}).get("default")
    fields = {f"ppo.{k}": v for k, v in dataclasses.asdict(c).items() if k not in NOT_SHAPING_FIELDS}
    value, reward = trainer.value_model(), getattr(trainer.reward, "model", trainer.reward)

    def where(src) -> str | None:
        if not src:
            return None
        return checkpoint.portable_path(src, trainer.work, trainer.work.parent) if trainer.work else str(src)

    frozen = next((q for q in (trainer.ref if trainer.ref is not None else trainer.unwrapped).parameters()
                   if not q.requires_grad), None)
    targets = getattr(lora, "target_modules", None)
    return {
        **fields,
        **trainer.run_record,
        "ppo.total_episodes": sz.num_updates * sz.batch_size,
        "ppo.per_device_train_batch_size": sz.micro_batch_size,
        "ppo.gradient_accumulation_steps": sz.gradient_accumulation_steps,
        "ppo.num_mini_batches": sz.num_mini_batches,
        "device.num_processes": sz.world_size,
        "ppo.num_ppo_epochs": c.num_ppo_epochs,
        "ppo.response_length": c.response_length,
        "ppo.advantage": c.advantage,
        "ppo.samples_per_prompt": c.samples_per_prompt,
        "ppo.reward": list(c.reward),
        "ppo.learning_rate": c.learning_rate,
        "ppo.value_learning_rate": c.value_learning_rate,
        "ppo.lr_scheduler_type": c.lr_scheduler_type,
        "ppo.warmup_ratio": c.warmup_ratio,
        "ppo.weight_decay": c.weight_decay,
        "ppo.lora.enabled": lora is not None,
        "ppo.lora.r": getattr(lora, "r", None),
        "ppo.lora.alpha": getattr(lora, "lora_alpha", None),
        "ppo.lora.target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
        "ppo.value_lora": hasattr(value, "peft_config") if value is not None else None,
        "ppo.policy_dir": where(lora.base_model_name_or_path if lora is not None
                                else getattr(trainer.unwrapped, "name_or_path", None)),
        "ppo.reward_dir": where(getattr(reward, "name_or_path", None)) if reward is not None else None,
        "model.dtype": str(frozen.dtype).replace("torch.", "") if frozen is not None else None,
    }


def save(trainer) -> Path:
    """Checkpoint `checkpoints/checkpoint-<update>` (main process writes; every process takes part)."""
    consumed = [trainer.stream.consumed]
    rngs = [checkpoint.rng_state(trainer.device)]
    if trainer.world > 1:
        import torch.distributed as dist

        consumed = trainer.acc.gather(torch.tensor([trainer.stream.consumed], device=trainer.device)).tolist()
        rngs = [None] * trainer.world
        dist.all_gather_object(rngs, checkpoint.rng_state(trainer.device))
    path = trainer.work / "checkpoints" / f"checkpoint-{trainer.progress.update}"
    with shard.whole(trainer.unwrapped, trainer.value_model(), trainer.optimizer):  # sharded: gathered by every process
        if trainer.acc.is_main_process:
            state = {"update": trainer.progress.update, "episodes": trainer.progress.episodes,
                     "scheduler": trainer.scheduler.state_dict(), "kl_ctl": trainer.kl_ctl.state_dict(),
                     "prompts_consumed": consumed, "metrics": trainer.progress.metrics, "config": run_config(trainer)}
            checkpoint.save(path, trainer.unwrapped, trainer.value_model(), trainer.tok, state,
                            trainer.optimizer.state_dict(), rngs, root=trainer.work.parent)
            trainer.hooks.on_save(path)
            checkpoint.prune(path.parent, trainer.c.save_total_limit)  # after `path` is complete
    trainer.acc.wait_for_everyone()
    return path


def resume(trainer, path: Path, force: bool = False) -> None:
    """Continue from checkpoint `path`: weights, optimizer, scheduler, KL controller, counters, RNG, once
    `checkpoint.load` has checked all of it against this run. `force` (ppo.resume=force): a run config that
    changed continues with the new values (learning rates, schedule, weight decay from here on)."""
    fresh = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in trainer.optimizer.param_groups]
    with shard.whole(trainer.unwrapped, trainer.value_model(), trainer.optimizer):  # sharded: whole tensors into shards
        st = checkpoint.load(path, trainer.unwrapped, trainer.value_model(), trainer.rank, optimizer=trainer.optimizer,
                             run_config=run_config(trainer), force=force,
                             states={"scheduler": trainer.scheduler.state_dict(), "kl_ctl": trainer.kl_ctl.state_dict()})
        trainer.optimizer.load_state_dict(st["optimizer"])
    trainer.scheduler.load_state_dict(st["scheduler"])
    if st["changed"]:
        _continue_with(trainer, fresh)
    kl_changed = [k for k in st["changed"] if k in KL_KEYS]
    if kl_changed:  # ppo.resume=force with a new KL setting: the controller restarts from it
        log.warning("ppo.resume=force: %s changed; the KL controller restarts at kl_coef=%g instead of the "
                    "checkpoint's %s", ", ".join(kl_changed), trainer.kl_ctl.value, st["kl_ctl"].get("value"))
    else:
        trainer.kl_ctl.load_state_dict(st["kl_ctl"])
    trainer.progress = Progress(update=st["update"], episodes=st["episodes"], metrics=st.get("metrics", {}))
    consumed = st["prompts_consumed"]
    trainer.stream.consumed = consumed[trainer.rank] if trainer.rank < len(consumed) else consumed[0]
    checkpoint.set_rng_state(*st["rng"], trainer.device)
    # best/ of the interrupted run stays the best so far, also when written after the checkpoint resumed
    # from: it is an update this run trained and evaluated. Another metric than this run's starts over.
    name, sign = trainer.keep or (None, 0.0)
    best = evaluation.read_best(trainer.work / "best") if name else None
    if best and (best.get("metric"), best.get("higher_is_better")) == (name, sign > 0):
        trainer.best = best


def _continue_with(trainer, fresh: list[dict]) -> None:
    """This run's optimizer hyper-parameters (`fresh`, one dict per group) instead of the checkpoint's, and
    its schedule's learning rate at the step reached."""
    groups, sch = trainer.optimizer.param_groups, trainer.scheduler
    for g, f in zip(groups, fresh):
        g.update(f)
    sch.base_lrs = [g["initial_lr"] for g in groups]
    sch.last_epoch -= 1  # the scheduler's own step sets every group's lr at the step reached, from the new bases
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": this process's first step
        warnings.simplefilter("ignore", UserWarning)
        sch.step()
