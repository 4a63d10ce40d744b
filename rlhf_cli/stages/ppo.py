"""`rlhf ppo`: PPO-RLHF with a LoRA policy, the frozen base as reference (adapter disabled), a separate value
model (gae; the critic-free estimators grpo, rloo and reinforce_pp have none) and the reward of `ppo.reward`: a
frozen reward model, Python functions, or a weighted sum of them. The algorithm is `rlhf_cli.ppo` (trainer,
experience, core, rewards); this stage composes it from the config, runs it, and publishes the result.

Outputs (`ppo.output_dir`): the LoRA adapter at the top (`AutoPeftModelForCausalLM.from_pretrained` loads it),
the tokenizer, value/ (value model; gae only), checkpoints/checkpoint-N/ (what trains, optimizer, scheduler,
RNG state, counters; no pickle), tensorboard/, metrics.json, and merged/ with `merge=true`. The run is built in
the hidden sibling `.<name>.partial` and moved into place at the end, so a failed run never replaces an earlier
good output; `ppo.resume=true` continues the partial run from its latest checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from rlhf_cli.config import ppo_sizes, require_dir
from rlhf_cli.errors import RlhfError
from rlhf_cli.io import check_output_dir, publish, read_json, write_json
from rlhf_cli.models import build_ppo_models, check_vocab, load_tokenizer, merge_lora, resolve_precision, setup_torch
from rlhf_cli.ppo import checkpoint
from rlhf_cli.ppo.config import REWARD_MODEL, PPOConfig
from rlhf_cli.ppo.rewards import RewardFunction
from rlhf_cli.ppo.trainer import Hooks, PPOTrainer, PromptStream
from rlhf_cli.stages import _sampling
from rlhf_cli.tracking import make_writer

log = logging.getLogger("rlhf")


def work_dir(out: Path, resume: bool) -> Path:
    """The hidden directory the run is built in. resume=true continues it; a finished run is not resumed."""
    work = out.parent / f".{out.name}.partial"
    if resume:
        if checkpoint.latest(work / "checkpoints") is not None:
            return work
        if (out / "metrics.json").exists():
            done = read_json(out / "metrics.json").get("total_episodes")
            raise RlhfError(f"ppo.resume=true: {out} is a finished run ({done} episodes) and nothing was "
                            "interrupted; drop ppo.resume=true to train a new run (it replaces this one only when "
                            "it succeeds)")
        raise RlhfError(f"ppo.resume=true but there is no interrupted run to resume at {work}; drop resume=true")
    check_output_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def run(cfg, hooks: Hooks | None = None) -> dict:
    setup_torch(cfg)
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from rlhf_cli.launch import accelerator_kwargs

    p = cfg.ppo
    c = PPOConfig.from_cfg(p)
    acc = Accelerator(**accelerator_kwargs(cfg.device))
    sizes = ppo_sizes(p, acc.num_processes)
    c.check(sizes.local_batch_size)
    storage, compute = resolve_precision(cfg)

    # ---- tokenizer, prompts, reward functions and ground truth (a broken one fails before any model loads)
    policy_dir = require_dir(p.policy_dir, "SFT policy (ppo.policy_dir)", "rlhf sft")
    tok = load_tokenizer(policy_dir, cfg.model)
    prompts, examples = _sampling.prompts(cfg, tok, "train")
    rows = _sampling.rows(examples)
    extra = {k for r in rows for k in r}
    functions = {spec: RewardFunction.load(spec, extra) for spec in c.reward if spec != REWARD_MODEL}
    gt = _sampling.ground_truth(cfg, examples)

    # ---- models, sampling
    models = build_ppo_models(cfg, tok, acc.device, storage)
    vocab = check_vocab(tok, models.policy, policy_dir)
    recompute = _sampling.recompute_logprobs(c.recompute_logprobs, compute)
    sampling = _sampling.sampling(cfg, tok, vocab, recompute)

    # ---- output / resume
    out = Path(p.output_dir)
    if acc.is_main_process:
        work_dir(out, bool(p.resume))
    acc.wait_for_everyone()
    work = out.parent / f".{out.name}.partial"
    writer = make_writer(cfg, work / "tensorboard", acc.is_main_process)  # TensorBoard, and wandb if asked
    trainer = PPOTrainer(c, sizes, models, tok, PromptStream(prompts, int(cfg.seed), acc.process_index,
                                                             acc.num_processes, rows),
                         sampling, acc, work, compute_dtype=compute, ground_truth=gt, writer=writer, hooks=hooks,
                         reward_functions=functions)
    if p.resume:
        ckpt = checkpoint.latest(work / "checkpoints")
        trainer.resume(ckpt)
        log.info("ppo: resumed from %s at update %d (%d episodes)", ckpt, trainer.progress.update,
                 trainer.progress.episodes)
    log.info("ppo: %d updates × %d episodes (%d process(es) × %d micro × %d accumulation × %d mini-batches), "
             "%d PPO epochs, response_length %d, lr %g, kl_coef %g; value model from %s; weights %s, compute %s%s",
             sizes.num_updates, sizes.batch_size, acc.num_processes, sizes.micro_batch_size,
             sizes.gradient_accumulation_steps, sizes.num_mini_batches, c.num_ppo_epochs, c.response_length,
             c.learning_rate, c.kl_coef, models.value_source, str(storage).replace("torch.", ""),
             str(compute).replace("torch.", "") if compute else "float32",
             ", log-probs recomputed" if recompute else "")
    if c.advantage != "gae" or c.samples_per_prompt > 1 or c.reward != (REWARD_MODEL,):
        log.info("ppo: advantage %s, %d response(s) per prompt; reward %s", c.advantage, c.samples_per_prompt,
                 " + ".join(f"{w:g}·{spec}" for spec, w in zip(c.reward, c.weights())))
    bar = tqdm(total=sizes.num_updates * sizes.batch_size, initial=trainer.progress.episodes, unit="ep",
               desc="ppo", disable=not acc.is_main_process, dynamic_ncols=True)
    user_on_update = trainer.hooks.on_update

    def on_update(update: int, m: dict) -> None:
        bar.update(sizes.batch_size)
        if acc.is_main_process and (update % max(c.logging_steps, 1) == 0 or update == sizes.num_updates):
            gt_s = f" gt {m['objective/ground_truth_rate']:.2f}" if gt else ""
            vf_s = f" vf {m['loss/value_avg']:.3f}" if "loss/value_avg" in m else ""
            zero_s = f" zero-std {m['reward/frac_zero_std']:.2f}" if "reward/frac_zero_std" in m else ""
            bar.write(f"update {update}/{sizes.num_updates} ep {m['episodes']} score {m['objective/scores']:+.2f}"
                      f" kl {m['objective/kl']:.2f}{gt_s} len {m['response/length_mean']:.1f}"
                      f" pg {m['loss/policy_avg']:+.3f}{vf_s}{zero_s}"
                      f" clip {m['policy/clipfrac_avg']:.2f} eps {m['eps']:.1f}")
        user_on_update(update, m)

    trainer.hooks.on_update = on_update
    t_start = time.perf_counter()
    try:
        metrics = trainer.train()
    except KeyboardInterrupt:
        saved = checkpoint.latest(work / "checkpoints")
        log.error("ppo: interrupted; %s", f"`ppo.resume=true` continues from {saved}" if saved else
                  "no checkpoint was written yet (ppo.save_every), nothing to resume")
        raise
    finally:
        bar.close()

    # ---- final outputs: adapter + tokenizer at the top, value model, optional merged model; then publish
    if acc.is_main_process:
        checkpoint.save_model(trainer.unwrapped, work)
        tok.save_pretrained(str(work))
        if trainer.value is not None:
            checkpoint.save_model(trainer.value_model(), work / "value")
        if p.merge and p.lora.enabled:
            import copy

            merged = merge_lora(copy.deepcopy(trainer.unwrapped))
            merged.save_pretrained(str(work / "merged"))
            tok.save_pretrained(str(work / "merged"))
        total = time.perf_counter() - t_start
        summary = {**metrics, "updates": sizes.num_updates, "total_episodes": trainer.progress.episodes,
                   "train_seconds": round(total, 2), "world_size": acc.num_processes,
                   "policy_dir": str(Path(p.policy_dir).resolve()),
                   "reward_dir": str(Path(p.reward_dir).resolve()) if c.uses_reward_model else None,
                   "advantage": c.advantage, "reward": list(c.reward)}
        write_json(work / "metrics.json", summary)
        writer.close()
        publish(work, out)
        log.info("ppo: %d episodes in %.1f s; wrote %s", trainer.progress.episodes, total, out)
    acc.wait_for_everyone()
    acc.end_training()
    return metrics
