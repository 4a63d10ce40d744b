"""`rlhf ppo`: PPO-RLHF with a LoRA policy, the frozen base as reference (adapter disabled), a separate value
model (gae; the critic-free estimators grpo, rloo and reinforce_pp have none) and the reward of `ppo.reward`: a
frozen reward model, Python functions, or a weighted sum of them. The algorithm is `rlhf_cli.ppo` (trainer,
experience, core, rewards); this stage composes it from the config, runs it, and publishes the result.

Outputs (`ppo.output_dir`): the LoRA adapter at the top (`AutoPeftModelForCausalLM.from_pretrained` loads it),
the tokenizer, value/ (value model; gae only), checkpoints/checkpoint-N/ (what trains, optimizer, scheduler,
RNG state, counters; no pickle), tensorboard/, metrics.json, merged/ with `merge=true`, and best/ with
`ppo.keep_best` (the adapter and value/ of the best update by `ppo.eval_every`'s held-out evaluation, best.json
naming it; `rlhf eval`, `chat` and `export` take it like the top). The run is built in
the hidden sibling `.<name>.partial` and moved into place at the end, so a failed run never replaces an earlier
good output; `ppo.resume=true` continues the partial run from its latest checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlhf_cli import accel, devices, resume, settings
from rlhf_cli.config import ppo_sizes, require_dir
from rlhf_cli.hardware import resolve_precision, setup_torch
from rlhf_cli.io import publish
from rlhf_cli.models import check_vocab, load_tokenizer
from rlhf_cli.ppo import evaluation, shard
from rlhf_cli.ppo.build import build_ppo_models
from rlhf_cli.ppo.config import REWARD_MODEL, PPOConfig
from rlhf_cli.ppo.reward_model import know_prompts
from rlhf_cli.ppo.rewards import RewardFunction
from rlhf_cli.ppo.trainer import Hooks, PPOTrainer, PromptStream
from rlhf_cli.stages import _sampling
from rlhf_cli.stages._console import console, describe_run, final_line, show_evaluations
from rlhf_cli.stages._ppo_outputs import warn_what_did_not_learn, write_cards, write_outputs
from rlhf_cli.tracking import make_writer

log = logging.getLogger("rlhf")


def run(cfg, hooks: Hooks | None = None) -> dict:
    """The stage reads its typed settings (rlhf_cli.settings.of); the composed config `cfg` itself is only
    recorded: the run record a resume compares, the config wandb keeps, the model cards."""
    t_run = time.perf_counter()  # the wall time of the whole stage, loading included, for its last line
    typed = settings.of(cfg)
    setup_torch(typed)
    from accelerate import Accelerator

    from rlhf_cli.launch import accelerator_kwargs

    p = typed.ppo
    c = PPOConfig.from_cfg(p)
    acc = Accelerator(**accelerator_kwargs(typed.device))
    sizes = ppo_sizes(p, acc.num_processes)
    c.check(sizes.local_batch_size)
    storage, compute = resolve_precision(typed)

    # ---- tokenizer, prompts, reward functions and ground truth (a broken one fails before any model loads)
    policy_dir = require_dir(p.policy_dir, "SFT policy (ppo.policy_dir)", "rlhf sft")
    tok = load_tokenizer(policy_dir, typed.model)
    prompts, examples = _sampling.prompts(typed, tok, "train")
    rows = _sampling.rows(examples)
    extra = {k for r in rows for k in r}
    functions = {spec: RewardFunction.load(spec, extra, timeout_s=p.reward_timeout_s, retries=p.reward_retries,
                                           max_abs=p.reward_max_abs)
                 for spec in c.reward if spec != REWARD_MODEL}  # a URL: a reward server (RemoteReward)
    gt = _sampling.ground_truth(typed.data, examples)
    held_out = _sampling.held_out(typed, tok, c.eval_every)
    evaluation.keep_best_metric(c.keep_best, c.eval_every, evaluation.metric_names(c.uses_reward_model,
                                                                                    gt is not None))

    # ---- the run directory (claimed before any model loads: a second run is refused at once), models, trainer
    out = Path(p.output_dir)
    if acc.is_main_process:
        resume.claim(out, "ppo", p.resume != "false", bool(p.fresh),  # ppo.resume: true, false or force
                     inputs=[p.policy_dir, p.reward_dir, p.value_init])
    acc.wait_for_everyone()
    work = resume.partial_dir(out)
    paths = accel.configure(typed, acc.device.type)
    models = build_ppo_models(typed, tok, devices.resolve(acc.device), storage, paths, acc.num_processes)
    know_prompts(models.reward, (prompts, examples), held_out)  # a reward model with its own tokenizer needs them
    recompute = _sampling.recompute_logprobs(c.recompute_logprobs, compute)
    vocab = check_vocab(tok, models.policy, policy_dir)
    sampling = _sampling.sampling(typed, tok, vocab, recompute, engine=paths.sampler,
                                  score_batch_size=_sampling.score_batch_size(typed, sizes.micro_batch_size, vocab))
    evaluator = _sampling.evaluator(typed, tok, vocab, recompute, paths.sampler, held_out)
    stream = PromptStream(prompts, int(typed.seed), acc.process_index, acc.num_processes, rows)
    trainer = PPOTrainer(c, sizes, models, tok, stream, sampling, acc, work, compute_dtype=compute, ground_truth=gt,
                         hooks=hooks, reward_functions=functions, evaluator=evaluator)
    # the record a resume compares, the resume, then TensorBoard / wandb (a refused resume writes nothing)
    trainer.run_record = {**resume.ppo_record(cfg), **resume.model_identities(cfg, "ppo")}
    _resume(trainer, p.resume, work)
    writer = trainer.writer = make_writer(typed, work / "tensorboard", acc.is_main_process, composed=cfg)
    describe_run(c, sizes, acc.num_processes, models.value_source, storage, compute, recompute)
    if evaluator is not None:
        log.info("ppo: every %d updates and after the last, %d held-out prompts sampled with the eval settings "
                 "(eval/* metrics)%s", c.eval_every, len(evaluator.prompts),
                 f"; the best update by {c.keep_best} kept in {out / 'best'}" if c.keep_best else "")
        if acc.is_main_process:
            show_evaluations(trainer)

    if acc.is_main_process:  # before the first update: what SFT and the reward stage did not learn, then gaming
        warn_what_did_not_learn(trainer, p)

    # ---- train, with a progress bar and a line per update
    t_start = time.perf_counter()
    with console(trainer, acc.is_main_process):
        metrics = trainer.train()
    with shard.whole(trainer.unwrapped, trainer.value_model()):  # sharded: gathered by every process
        if acc.is_main_process:
            write_outputs(trainer, tok, work, typed, time.perf_counter() - t_start)
            write_cards(work, cfg, {"train_prompts": len(prompts),
                                    "eval_prompts": len(held_out[0]) if held_out is not None else None})
            writer.close()
            publish(work, out, "ppo")
            log.info(final_line(trainer.progress.update, trainer.progress.episodes, time.perf_counter() - t_run,
                                metrics, out))
    acc.wait_for_everyone()
    acc.end_training()
    return metrics


def _resume(trainer: PPOTrainer, setting: str, work: Path) -> None:
    """`ppo.resume` (`setting`: true, false or force, as its typed setting holds it): the run's shape compared
    with the latest checkpoint's and its state loaded."""
    if setting == "false":
        return
    ckpt = resume.latest(work / "checkpoints")
    trainer.resume(ckpt, force=setting == "force")
    log.info("ppo: resumed from %s at update %d (%d episodes)", ckpt, trainer.progress.update,
             trainer.progress.episodes)
