"""The PPO-RLHF loop (`PPOTrainer.train`), one numbered step at a time:

    step 1+2. make_experience     sample n responses for each prompt of a batch and score them (old / reference
                                  log-probs, values, reward-model scores and reward functions, summed and shaped)
    step 3+4. compute_advantages  the estimator of `ppo.advantage`: gae (per-token rewards with the KL penalty,
                                  value model, GAE, whitened), grpo / rloo (the n responses to a prompt compared),
                                  reinforce_pp (reward-to-go, whitened over the batch)
    step 5.   update              PPO epochs over shuffled mini-batches, micro-batches with gradient accumulation
    step 6.   log / save          metrics, sample table, checkpoint; every `ppo.eval_every` updates the
                                  evaluator's held-out `eval/*` metrics, the best update's adapter in best/

The trainer does no config parsing and no printing of its own: the CLI stage builds it (models, prompts,
`PPOConfig`, `PPOSizes`, the `evaluation.Evaluator`), and the benchmark and the stage observe it through `Hooks`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from rlhf_cli import devices
from rlhf_cli.errors import RlhfError
from rlhf_cli.gpu_memory import PhasePeaks
from rlhf_cli.learned import rm_gt_disagreement
from rlhf_cli.ppo import core, evaluation, rewards, run_state, shard
from rlhf_cli.ppo.config import REWARD_MODEL, PPOConfig
from rlhf_cli.ppo.experience import Experience, Sampling, make_experience
from rlhf_cli.ppo.forward import leading_padding, padding_counts, policy_logits
from rlhf_cli.ppo.run_state import Progress

if TYPE_CHECKING:
    from rlhf_cli.ppo.build import PPOModels

log = logging.getLogger("rlhf")

STAT_KEYS = ("pg_loss", "vf_loss", "approxkl", "clipfrac", "vf_clipfrac", "entropy", "ratio", "kl_loss")


@dataclass
class Hooks:
    """Observation points for the CLI and the benchmark (no patching of the trainer)."""

    on_train_start: Callable[[PPOTrainer], None] = lambda trainer: None
    on_update_start: Callable[[int], None] = lambda update: None
    on_update: Callable[[int, dict], None] = lambda update, metrics: None
    on_save: Callable[[Path], None] = lambda path: None
    clock: Callable[[], float] = time.perf_counter


def adamw(groups: list[dict], accelerator, **kw) -> torch.optim.AdamW:
    """torch's AdamW, fused (one kernel per parameter instead of ~10 element-wise passes, and no temporaries the
    size of the parameters) where the parameters stay plain tensors: one process or DDP. Under DeepSpeed and FSDP,
    which reshape or shard the parameters, and where a device has no fused kernel, the default implementation."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        try:
            return torch.optim.AdamW(groups, fused=True, **kw)
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
            pass
    return torch.optim.AdamW(groups, **kw)


def by_padding(perm: torch.Tensor, attention_mask: torch.Tensor, mini_batch: int) -> torch.Tensor:
    """`perm` with each mini-batch's rows stably ordered by their prompt's leading padding, so that consecutive
    micro-batches hold prompts of similar length and `leading_padding` can skip more columns. Which rows make a
    mini-batch (and so an optimizer step) stays random; only their grouping into micro-batches changes."""
    lead = padding_counts(attention_mask)[perm]
    chunks = [torch.sort(lead[i: i + mini_batch], stable=True).indices + i for i in range(0, perm.numel(), mini_batch)]
    return perm[torch.cat(chunks)]


class PromptStream:
    """Repeating, shuffled prompt stream; each process takes a disjoint shard. Its position is a checkpoint
    counter, so a resumed run continues with the prompts it would have seen. `rows` (optional, one dict per
    prompt) are the data rows' extra fields that reward functions may ask for."""

    def __init__(self, prompts: list[str], seed: int, rank: int, world: int, rows: list[dict] | None = None) -> None:
        self.prompts, self.seed, self.rank, self.world = prompts, seed, rank, world
        self.rows = rows
        self.consumed = 0  # prompts taken by this process so far

    def _order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.prompts)))
        random.Random(self.seed + epoch).shuffle(idx)
        return idx[self.rank:: self.world] or idx

    def take_indices(self, n: int) -> list[int]:
        """The next `n` prompts of this process's shard, as indices into `prompts` / `rows`."""
        out = []
        while len(out) < n:
            shard_epoch, pos = divmod(self.consumed, len(self._order(0)))
            order = self._order(shard_epoch)
            take = min(n - len(out), len(order) - pos)
            out.extend(order[pos: pos + take])
            self.consumed += take
        return out

    def take(self, n: int) -> list[str]:
        return [self.prompts[i] for i in self.take_indices(n)]


class PPOTrainer:
    def __init__(self, c: PPOConfig, sizes, models: PPOModels, tok, stream: PromptStream, sampling: Sampling,
                 accelerator, work_dir: Path, compute_dtype: torch.dtype | None = None,
                 ground_truth: rewards.GroundTruth | Callable[[str], bool] | None = None, writer=None,
                 hooks: Hooks | None = None, reward_functions: dict[str, Callable] | None = None,
                 evaluator: Callable[[PPOTrainer], dict[str, float]] | None = None):
        """`reward_functions`: the loaded `ppo.reward` functions by their spec (loaded here when not given);
        `ground_truth`: a `rewards.GroundTruth`, or a plain function of one response text; `evaluator`: called
        with the trainer every `ppo.eval_every` updates and after the last, returns `eval/*` metrics (an
        `evaluation.Evaluator`; every process calls it and must get the same numbers); None: no evaluation."""
        from transformers import get_scheduler

        c.check(sizes.local_batch_size)
        if compute_dtype == torch.float16:  # sft/reward get the Trainer's loss scaler; this loop has none
            raise RlhfError("ppo: fp16 mixed precision needs a gradient scaler, which rlhf ppo does not run; use "
                            "device.mixed_precision=bf16 (GPUs from Ampere on) or device.mixed_precision=no")
        self.c, self.sizes, self.tok, self.stream, self.sampling = c, sizes, tok, stream, sampling
        self.acc, self.work, self.compute_dtype = accelerator, work_dir, compute_dtype
        if ground_truth is not None and not isinstance(ground_truth, rewards.GroundTruth):
            ground_truth = rewards.GroundTruth(getattr(ground_truth, "__name__", "ground_truth"), ground_truth,
                                               frozenset())
        self.ground_truth, self.writer, self.hooks = ground_truth, writer, hooks or Hooks()
        # resolved once: accelerate's one-process device is `cuda` with no index, its tensors' is cuda:0
        self.device = devices.resolve(accelerator.device)
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.peaks = PhasePeaks(self.device)
        self.ref, self.reward, self.score_stats = models.ref, models.reward, models.score_stats
        if c.uses_reward_model and models.reward is None:
            raise RlhfError(f"ppo.reward={list(c.reward)} names the reward model, but none was loaded")
        extra = {k for r in (stream.rows or []) for k in r}
        self.reward_functions = dict(reward_functions or {})
        for spec in c.reward:
            if spec != REWARD_MODEL and spec not in self.reward_functions:
                self.reward_functions[spec] = rewards.RewardFunction.load(spec, extra)
        self.source_names = rewards.source_names(c.reward)
        # one AdamW, two parameter groups (policy, value) with their own learning rates; fp32 master weights
        self.pol_params = [q for q in models.policy.parameters() if q.requires_grad]
        self.val_params = [q for q in models.value.parameters() if q.requires_grad] if models.value is not None \
            else []
        groups = [{"params": self.pol_params, "lr": c.learning_rate}]
        if models.value is not None:
            groups.append({"params": self.val_params, "lr": c.value_lr})
        optimizer = adamw(groups, accelerator, lr=c.learning_rate, weight_decay=c.weight_decay, eps=1e-5)
        for hook in getattr(models, "on_optimizer", ()):
            hook(optimizer)
        total_steps = sizes.num_updates * c.num_ppo_epochs * sizes.num_mini_batches
        self.scheduler = get_scheduler(c.lr_scheduler_type, optimizer,
                                       num_warmup_steps=int(c.warmup_ratio * total_steps),
                                       num_training_steps=total_steps)
        # DDP replicas, or models sharded at build time as they are; value None: critic-free
        self.policy, self.value, self.optimizer = shard.prepare(accelerator, models.policy, models.value, optimizer)
        if self.world > 1:
            # weights are already in sync (DDP broadcasts rank 0's); sampling must differ between ranks
            torch.manual_seed(int(stream.seed) + self.rank)
        self.unwrapped = accelerator.unwrap_model(self.policy)
        self.kl_ctl = (core.AdaptiveKLController(c.kl_coef, c.adaptive_kl_target, c.kl_horizon) if c.adaptive_kl
                       else core.FixedKLController(c.kl_coef))
        self.progress = Progress()
        self.run_record: dict = {}  # more run-shaping keys from the stage (rlhf_cli.resume.ppo_record)
        self.evaluator = evaluator if c.eval_every else None  # none given: no evaluation
        self.keep = evaluation.keep_best_metric(c.keep_best, c.eval_every)  # (metric, sign) or None
        if self.keep is not None and self.evaluator is None:
            raise RlhfError(f"ppo.keep_best={c.keep_best} but the trainer was given no evaluator")
        self.best: dict | None = None  # best.json of best/: the update kept, its metric and value

    # ------------------------------------------------------------------------------------------ helpers
    def trainable(self) -> list[torch.Tensor]:
        """Every parameter the optimizer steps (what the gradient norm is taken over)."""
        return [q for group in self.optimizer.param_groups for q in group["params"]]

    def autocast(self):
        """Forward passes run under autocast at the compute dtype; trainable weights stay fp32."""
        return devices.autocast(self.device, self.compute_dtype)

    def clock(self) -> float:
        """The hooks' clock once the device's queued work is done, so that a phase's time is its work's."""
        devices.synchronize(self.device)
        return self.hooks.clock()

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """The one way a tensor enters a collective: on this process's device (NCCL takes no CPU tensor; gloo
        would, so the CPU tests catch a misplaced tensor here)."""
        if not devices.same(t.device, self.device):
            raise RuntimeError(f"a {tuple(t.shape)} tensor on {t.device} would enter a collective of processes on "
                               f"{self.device}")
        return self.acc.reduce(t, op) if self.world > 1 else t

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.reduce(t, "sum")

    def global_mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.reduce(t.float().mean(), "mean")

    def value_model(self):
        """The value model's sequence-classification model (what is saved), or None (critic-free)."""
        return self.acc.unwrap_model(self.value).model if self.value is not None else None

    def _fail(self, what: str, fix: str) -> None:
        raise RlhfError(f"ppo: {what} at update {self.progress.update + 1}; {fix}")

    # ---------------------------------------------------------------------------------- step 1 + 2
    def make_experience(self) -> Experience:
        """Sample n responses to each prompt of one batch (the n in consecutive rows) and score them."""
        c, n = self.c, self.c.samples_per_prompt
        idx = [i for i in self.stream.take_indices(self.sizes.local_batch_size // n) for _ in range(n)]
        with self.autocast():
            exp = make_experience([self.stream.prompts[i] for i in idx], self.tok, self.unwrapped,
                                  self.sampling, ref_model=self.ref, value_model=self.value,
                                  reward_model=self.reward, device=self.device, phase=self.peaks.phase)
        if exp.rm_scores is not None and not bool(torch.isfinite(exp.rm_scores).all()):
            self._fail("the reward model gave non-finite scores",
                       "the reward model is broken: retrain it (`rlhf reward` with a lower reward.learning_rate)")
        if (exp.values is not None and not bool(torch.isfinite(exp.values).all())) \
                or not bool(torch.isfinite(exp.logprobs).all()):
            self._fail("the policy or value model gave non-finite outputs",
                       f"lower ppo.learning_rate (now {c.learning_rate:g})")
        rows = [self.stream.rows[i] for i in idx] if self.stream.rows is not None else [{} for _ in idx]
        return self.score(exp.with_(rows=rows))

    def score(self, exp: Experience) -> Experience:
        """The score optimised: Σ weight · source over `ppo.reward` (the reward model's score normalised with its
        statistics, a function's as returned), then the missing-EOS penalty and the empty-response score."""
        c, parts, inputs = self.c, [], None
        for spec in c.reward:
            if spec == REWARD_MODEL:
                st = self.score_stats if c.normalize_scores else None
                part = core.shape_scores(exp.rm_scores, exp.has_stop, exp.empty,
                                         mean=st["mean"] if st else None, std=st["std"] if st else None)
            else:
                if inputs is None:
                    inputs = rewards.reward_inputs(exp, exp.rows or [{} for _ in exp.texts])
                values = self.reward_functions[spec](exp.prompts, exp.texts, **inputs)
                part = torch.tensor(values, dtype=torch.float32, device=exp.response_ids.device)
            parts.append(part)
        total = rewards.weighted_sum(parts, c.weights())
        scores = core.shape_scores(total, exp.has_stop, exp.empty,
                                   missing_eos_penalty=c.missing_eos_penalty if self.sampling.stop_ids else None,
                                   empty_score=c.empty_response_penalty)
        return exp.with_(scores=scores, source_scores=dict(zip(self.source_names, parts)))

    def check_first_update(self, exp: Experience) -> None:
        """Before any update the policy is the reference (LoRA starts at 0): their log-probs must agree."""
        tol = self.c.first_update_kl_tolerance
        if tol is None:
            tol = 1e-3 if self.compute_dtype is None else 2e-2
        kl = core.masked_mean((exp.logprobs - exp.ref_logprobs).abs(), exp.response_mask,
                              allreduce_sum=self.allreduce_sum).item()
        if kl <= tol:
            return
        if not self.sampling.recompute_logprobs:
            cause = ("the sampling pass and the full forward disagree at this precision; set "
                     "ppo.recompute_logprobs=true (or auto)")
        else:
            cause = ("the reference is not the starting policy: check that ppo.policy_dir is a plain SFT model "
                     "and that no adapter is stacked on it")
        raise RlhfError(f"ppo: |log π - log π_ref| is {kl:.3g} per token before any update (tolerance {tol:g}, "
                        f"ppo.first_update_kl_tolerance): {cause}")

    # ---------------------------------------------------------------------------------- step 3 + 4
    def compute_advantages(self, exp: Experience) -> Experience:
        """The advantages of `ppo.advantage`, and where each puts the KL penalty:

        gae           per-token rewards (β·KL on every token, the score on the last), GAE on the value model,
                      whitened over all processes [N+]
        reinforce_pp  the same per-token rewards, reward-to-go whitened over all processes, no critic [R++]
        rloo          sequence reward score − β·ΣKL, minus the mean of the other responses to the prompt [RLOO]
        grpo          the score alone, centred (and scaled by the std) within the prompt's group; the KL is a
                      loss term (`micro_batch_loss`) [GRPO]
        """
        c, mask, n = self.c, exp.response_mask, self.c.samples_per_prompt
        if c.advantage == "gae":
            rewards, kl = core.token_rewards(exp.scores, exp.logprobs, exp.ref_logprobs, mask, self.kl_ctl.value,
                                             estimator=c.kl_estimator)
            if c.whiten_rewards:
                rewards = core.masked_whiten(rewards, mask, keep_mean=True, allreduce_sum=self.allreduce_sum)
            advantages, returns = core.gae(rewards, exp.values, mask, c.gamma, c.lam)
            advantages = core.masked_whiten(advantages, mask, allreduce_sum=self.allreduce_sum)
            return exp.with_(rewards=rewards, kl=kl, advantages=advantages, returns=returns)
        if c.advantage == "reinforce_pp":
            rewards, kl = core.token_rewards(exp.scores, exp.logprobs, exp.ref_logprobs, mask, self.kl_ctl.value,
                                             estimator=c.kl_estimator)
            advantages = core.reinforce_pp_advantages(rewards, mask, c.gamma, allreduce_sum=self.allreduce_sum)
            return exp.with_(rewards=rewards, kl=kl, advantages=advantages)
        estimator = c.kl_loss_estimator if c.advantage == "grpo" else c.kl_estimator
        kl = core.kl_penalty(exp.logprobs, exp.ref_logprobs, estimator)
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
        if c.advantage == "rloo":
            rewards = exp.scores - self.kl_ctl.value * kl.sum(-1)
            return exp.with_(rewards=rewards, kl=kl, advantages=core.rloo_advantages(rewards, mask, n))
        advantages = core.grpo_advantages(exp.scores, mask, n, scale_by_std=c.scale_rewards)
        return exp.with_(kl=kl, advantages=advantages)

    # ---------------------------------------------------------------------------------------- step 5
    def _rows(self, exp: Experience, idx: torch.Tensor, start: int):
        """Inputs of micro-batch `idx`, the prompt padding shared by all its rows (before `start`) dropped."""
        return exp.input_ids[idx, start:], exp.attention_mask[idx, start:], exp.position_ids[idx, start:]

    def policy_loss(self, exp: Experience, idx: torch.Tensor, start: int) -> tuple[torch.Tensor, dict]:
        """The policy's part of the loss of one micro-batch: clipped surrogate, − ent_coef·entropy, and for GRPO
        + β·KL to the reference."""
        c = self.c
        ids, am, pos = self._rows(exp, idx, start)
        mask = exp.response_mask[idx]
        with self.autocast():
            logits = policy_logits(self.policy, ids, am, pos, exp.response_length, self.sampling.vocab_size)
        # the entropy keeps its graph only when it is a loss term (ppo.ent_coef)
        new_logprobs, tok_entropy = core.logprobs_and_entropy(logits, exp.response_ids[idx], c.temperature,
                                                              entropy_grad=bool(c.ent_coef))
        del logits
        pg_loss, pg = core.policy_loss(new_logprobs, exp.logprobs[idx], exp.advantages[idx], mask, c.cliprange,
                                       c.loss_aggregation)
        ent = core.masked_mean(tok_entropy, mask)
        loss = pg_loss - (c.ent_coef * ent if c.ent_coef else 0.0)
        kl_loss = torch.zeros((), device=pg_loss.device)
        if c.advantage == "grpo":  # [GRPO] eq. 3: + β·KL(π‖π_ref) per token, averaged as the policy loss is
            kl_loss = core.aggregate_loss(core.kl_penalty(new_logprobs, exp.ref_logprobs[idx], c.kl_loss_estimator),
                                          mask, c.loss_aggregation)
            loss = loss + self.kl_ctl.value * kl_loss
        return loss, {"pg_loss": pg_loss.detach(), "approxkl": pg["approxkl"], "clipfrac": pg["clipfrac"],
                      "entropy": ent.detach(), "ratio": pg["ratio"], "kl_loss": kl_loss.detach()}

    def value_loss(self, exp: Experience, idx: torch.Tensor, start: int) -> tuple[torch.Tensor, dict]:
        """The value model's part: vf_coef · clipped value loss (zero without a value model)."""
        zero = torch.zeros((), device=exp.response_ids.device)
        if self.value is None:
            return zero, {"vf_loss": zero, "vf_clipfrac": zero}
        ids, am, pos = self._rows(exp, idx, start)
        with self.autocast():
            vpred = self.value(ids, am, pos, response_length=exp.response_length)
        vf_loss, vf = core.value_loss(vpred, exp.values[idx], exp.returns[idx], exp.response_mask[idx],
                                      self.c.cliprange_value)
        return self.c.vf_coef * vf_loss, {"vf_loss": vf_loss.detach(), "vf_clipfrac": vf["clipfrac"]}

    def micro_batch_step(self, exp: Experience, idx: torch.Tensor, start: int, accumulation: int) -> torch.Tensor:
        """Backward of one micro-batch's loss / `accumulation`, the policy's part first: its activations and logits
        are freed before the value model's forward, so the two are never alive together. The gradients are
        those of the summed loss (the two models share no parameter). Returns the stats in STAT_KEYS order."""
        pol_loss, ps = self.policy_loss(exp, idx, start)
        self.acc.backward(pol_loss / accumulation)
        val_loss, vs = self.value_loss(exp, idx, start)
        if self.value is not None:
            self.acc.backward(val_loss / accumulation)
        st = {**ps, **vs}
        return torch.stack([st[k] for k in STAT_KEYS])

    def micro_batch_loss(self, exp: Experience, idx: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole loss of one micro-batch and its stats in STAT_KEYS order (for evaluating the objective)."""
        pol_loss, ps = self.policy_loss(exp, idx, start)
        val_loss, vs = self.value_loss(exp, idx, start)
        st = {**ps, **vs}
        return pol_loss + val_loss, torch.stack([st[k] for k in STAT_KEYS])

    def update(self, exp: Experience) -> dict[str, torch.Tensor]:
        """PPO epochs over shuffled mini-batches; one optimizer step per mini-batch. Returns the mean of each
        statistic over the optimizer steps (local to this process)."""
        c, sz, acc = self.c, self.sizes, self.acc
        steps = []
        self.policy.train()
        self.unwrapped.eval()  # modules stay in eval mode (no dropout); train() above only flags DDP
        if self.value is not None:
            self.value.train()
            acc.unwrap_model(self.value).eval()
        for _epoch in range(c.num_ppo_epochs):
            perm = by_padding(torch.randperm(sz.local_batch_size, device=self.device), exp.attention_mask,
                              sz.local_mini_batch_size)
            # per micro-batch, the prompt padding shared by all its rows is skipped (one host sync per epoch)
            starts = leading_padding(exp.attention_mask[perm], sz.micro_batch_size)
            for mb in range(sz.num_mini_batches):
                mb_idx = perm[mb * sz.local_mini_batch_size: (mb + 1) * sz.local_mini_batch_size]
                mb_stats = []
                for k in range(sz.gradient_accumulation_steps):
                    idx = mb_idx[k * sz.micro_batch_size: (k + 1) * sz.micro_batch_size]
                    sync = contextlib.ExitStack()
                    if k < sz.gradient_accumulation_steps - 1 and self.world > 1:
                        # gradients are all-reduced once per optimizer step, on the last micro-batch
                        sync.enter_context(acc.no_sync(self.policy))
                        if self.value is not None:
                            sync.enter_context(acc.no_sync(self.value))
                    with sync:
                        mb_stats.append(self.micro_batch_step(exp, idx, starts[mb * sz.gradient_accumulation_steps + k],
                                                              sz.gradient_accumulation_steps))
                s = dict(zip(STAT_KEYS, torch.stack(mb_stats).mean(0)))
                grad_norm = shard.full(acc.clip_grad_norm_(self.trainable(), c.max_grad_norm)) \
                    if c.max_grad_norm else None
                losses = torch.stack([s["pg_loss"], s["vf_loss"]])
                finite = torch.isfinite(losses).all() & (torch.isfinite(grad_norm) if grad_norm is not None else True)
                if not bool(finite):  # stop before the step: the weights (and the last checkpoint) stay finite
                    self._fail(f"the loss or gradient norm became non-finite (pg {s['pg_loss'].item():.3g}, "
                               f"vf {s['vf_loss'].item():.3g})", f"lower ppo.learning_rate (now {c.learning_rate:g})")
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                steps.append(s)
                if c.target_kl is not None and self.global_mean(s["approxkl"]).item() > c.target_kl:
                    break
            else:
                continue
            break  # target_kl reached: no more epochs
        self.policy.eval()
        if self.value is not None:
            self.value.eval()
        return {k: torch.stack([st[k] for st in steps]) for k in STAT_KEYS}

    # ---------------------------------------------------------------------------------------- step 6
    def metrics(self, exp: Experience, stats: dict[str, torch.Tensor]) -> dict[str, float]:
        """Global means over all processes, named as TRL and the N+ details name them. Besides: each reward
        source's mean (`reward/<name>`), the share of prompts whose n responses all got the same reward (they
        teach a group estimator nothing: `reward/frac_zero_std`), and the share of responses cut at the length
        limit without a stop token (`response/clipped_ratio`; 1 with fixed-length responses)."""
        gm, mask, c = self.global_mean, exp.response_mask, self.c
        non_score = (-self.kl_ctl.value * exp.kl).sum(-1)
        n_eos = exp.has_stop.float().sum()
        m = {"objective/scores": gm(exp.scores)}
        if exp.rm_scores is not None:
            m["objective/rm_scores"] = gm(exp.rm_scores)
        m.update({
            "objective/kl": gm(exp.kl.sum(-1)),
            "objective/entropy": gm(core.masked_sum(exp.entropy, mask, dim=-1)),
            "objective/non_score_reward": gm(non_score),
            "objective/rlhf_reward": gm(exp.scores + non_score),
            "policy/approxkl_avg": gm(stats["approxkl"]),
            "policy/clipfrac_avg": gm(stats["clipfrac"]),
            "policy/entropy_avg": gm(stats["entropy"]),
            "loss/policy_avg": gm(stats["pg_loss"]),
        })
        if exp.values is not None:
            vstats = core.value_loss(exp.values, exp.values, exp.returns, mask, c.cliprange_value)[1]
            m.update({"loss/value_avg": gm(stats["vf_loss"]), "val/clipfrac_avg": gm(stats["vf_clipfrac"]),
                      "val/explained_var": gm(vstats["explained_var"])})
        if c.advantage == "grpo":
            m["loss/kl_avg"] = gm(stats["kl_loss"])
        m.update({
            "val/ratio": gm(stats["ratio"]),
            "val/num_eos_tokens": self.allreduce_sum(n_eos),
            "response/length_mean": gm(mask.sum(-1)),
            "response/empty_rate": gm(exp.empty.float()),
            "response/clipped_ratio": gm((~exp.has_stop).float()),
        })
        for name, part in (exp.source_scores or {}).items():
            m[f"reward/{name}"] = gm(part)
        if c.samples_per_prompt > 1:
            m["reward/frac_zero_std"] = gm(core.group_zero_spread(exp.scores, c.samples_per_prompt).float())
        if self.ground_truth is not None:
            gt = self.ground_truth(exp.texts, exp.prompts, exp.rows)
            m["objective/ground_truth_rate"] = gm(torch.tensor(gt, dtype=torch.float32, device=self.device))
            if exp.rm_scores is not None:  # how often the RM and the checker disagree (rlhf_cli.learned)
                mid = self.score_stats["mean"] if self.score_stats else float(exp.rm_scores.mean())
                m["objective/rm_gt_disagreement"] = gm(torch.tensor(
                    rm_gt_disagreement(exp.rm_scores.tolist(), gt, mid), device=self.device))
        return {k: float(v) for k, v in m.items()}

    def log(self, exp: Experience, metrics: dict[str, float]) -> None:
        """TensorBoard scalars every update, a sample table every `sample_every` updates (main process)."""
        if self.writer is None or not getattr(self.writer, "enabled", True):
            return
        update, episodes = self.progress.update, self.progress.episodes
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, episodes)
        if self.c.sample_every and (update % self.c.sample_every == 0 or update == 1):
            q = self.tok.batch_decode(exp.input_ids[:4, : exp.context_length], skip_special_tokens=True)
            rows = [f"| {qq.strip()!r} | {rr.strip()!r} | {sc:+.2f} |"
                    for qq, rr, sc in zip(q, exp.texts[:4], exp.scores[:4].tolist())]
            self.writer.add_text("samples", "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows),
                                 episodes)

    # ----------------------------------------------------------------------------------- checkpoints
    # what a run saves and continues from lives in rlhf_cli.ppo.run_state; these are its entry points
    def run_config(self) -> dict:
        return run_state.run_config(self)

    def save(self) -> Path:
        return run_state.save(self)

    def resume(self, path: Path, force: bool = False) -> None:
        run_state.resume(self, path, force)

    # ------------------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, float]:
        """Run the remaining updates; returns the last update's metrics."""
        c, sz, clock = self.c, self.sizes, self.clock
        first = self.progress.update == 0
        self.hooks.on_train_start(self)
        for update in range(self.progress.update + 1, sz.num_updates + 1):
            self.hooks.on_update_start(update)
            t0 = clock()
            exp = self.make_experience()                           # step 1+2. sample and score
            if first and update == 1:
                self.check_first_update(exp)
            t_gen = clock() - t0
            exp = self.compute_advantages(exp)                     # step 3+4. rewards, advantages
            t1 = clock()
            with self.peaks.phase("train"):
                stats = self.update(exp)                           # step 5. PPO epochs
            t_train = clock() - t1
            self.progress.update, self.progress.episodes = update, self.progress.episodes + sz.batch_size
            metrics = self.metrics(exp, stats)                     # step 6. log, checkpoint
            elapsed = clock() - t0
            metrics.update({"lr": self.scheduler.get_last_lr()[0], "kl_coef": float(self.kl_ctl.value),
                            "eps": sz.batch_size / elapsed, "time/rollout_s": t_gen, "time/update_s": elapsed,
                            "time/train_s": t_train, "episodes": self.progress.episodes, **exp.extras})
            evaluated = self.evaluator is not None and (update % c.eval_every == 0 or update == sz.num_updates)
            if evaluated:                                          # held-out prompts (not counted in eps)
                t2 = clock()
                with self.peaks.phase("eval"):
                    metrics.update(self.evaluator(self))
                metrics["time/eval_s"] = clock() - t2
            metrics.update(self.peaks.take())                      # GPU peaks per phase (none off CUDA)
            self.progress.metrics = metrics
            self.kl_ctl.update(metrics["objective/kl"], sz.batch_size)
            if evaluated and self.keep is not None:
                self.keep_if_best(metrics)
            self.log(exp, metrics)
            self.hooks.on_update(update, metrics)
            if update == sz.num_updates or (c.save_every and update % c.save_every == 0):
                self.check_finite_weights()  # a checkpoint never holds what a NaN step left behind
                self.save()
        return self.progress.metrics

    def keep_if_best(self, metrics: dict[str, float]) -> None:
        """`ppo.keep_best`: when this update's evaluation beats the best so far (ties keep the earlier one), its
        adapter and value model replace `best/` in the run directory, published with the final ones."""
        name, sign = self.keep
        if name not in metrics:
            evaluated = ", ".join(k for k in metrics if k.startswith("eval/"))
            raise RlhfError(f"ppo.keep_best={self.c.keep_best}: the evaluation gave no {name} (it gave {evaluated})")
        if not evaluation.is_better(metrics[name], self.best, sign):
            return
        self.check_finite_weights()
        self.best = {"update": self.progress.update, "episodes": self.progress.episodes, "metric": name,
                     "value": metrics[name], "higher_is_better": sign > 0,
                     "eval": {k: v for k, v in metrics.items() if k.startswith("eval/")}}
        with shard.whole(self.unwrapped, self.value_model()):
            if self.acc.is_main_process:
                evaluation.write_best(self.work / "best", self.unwrapped, self.value_model(), self.tok, self.best,
                                      root=self.work.parent)
        self.acc.wait_for_everyone()

    def check_finite_weights(self) -> None:
        """Nothing non-finite is published."""
        for p in self.pol_params + self.val_params:
            if not bool(torch.isfinite(p).all()):
                self._fail("a trained weight became non-finite",
                           f"lower ppo.learning_rate (now {self.c.learning_rate:g})")
        if not all(math.isfinite(v) for v in self.progress.metrics.values()):
            self._fail("a training metric became non-finite", f"lower ppo.learning_rate (now {self.c.learning_rate:g})")
