"""`rlhf ppo`: PPO-RLHF with a LoRA policy, the frozen base as reference (adapter disabled), a separate value
model and a frozen reward model. The maths lives in `rlhf_cli.ppo.core`; this file is the loop, one numbered
step at a time:

    step 1. sample responses for a batch of prompts (old log-probs from the sampling logits)
    step 2. score them: reference log-probs, values, reward-model scores, penalties
    step 3. per-token rewards (score at the last response token, -kl_coef·KL on every token)
    step 4. advantages and returns (GAE), advantages whitened with global statistics
    step 5. PPO epochs over shuffled mini-batches, micro-batches with gradient accumulation
    step 6. log, sample table, checkpoint

Outputs (`ppo.output_dir`): the LoRA adapter at the top (`AutoPeftModelForCausalLM.from_pretrained` loads it),
the tokenizer, value/ (value model), checkpoints/checkpoint-N/ (adapter, value model, optimizer, scheduler,
RNG state, counters), tensorboard/, metrics.json, and merged/ with `merge=true`. The run is built in a hidden
sibling directory and moved into place at the end, so a failed run never replaces an earlier good output.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import shutil
import time
from pathlib import Path

import torch

from rlhf_cli import data as D
from rlhf_cli.config import ppo_sizes, require_dir
from rlhf_cli.errors import RlhfError
from rlhf_cli.io import read_json, write_json
from rlhf_cli.models import (base_model_dir, load_causal_lm, load_kwargs, load_seq_cls, load_tokenizer,
                             lora_config, merge_lora, resolve_dtype, same_vocab, setup_torch)
from rlhf_cli.ppo import core
from rlhf_cli.ppo.rollout import (Rollout, TokenValueModel, generate_chunk, leading_padding, policy_logits,
                                  position_ids_from, response_slice)

log = logging.getLogger("rlhf")
STATE_FILE = "trainer_state.pt"


# ------------------------------------------------------------------------------------------------- models
def load_policy_base(path: Path, dtype, model_cfg):
    """The SFT policy as a plain model; an SFT LoRA adapter is merged first, so that "adapter disabled" is
    exactly the SFT policy once the PPO adapter is added."""
    if (path / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM

        peft_model = AutoPeftModelForCausalLM.from_pretrained(str(path), dtype=dtype, **load_kwargs(model_cfg))
        return merge_lora(peft_model)
    return load_causal_lm(path, dtype, model_cfg)


def build_models(cfg, tok, device):
    """(policy, ref_model or None, value model, reward model). With LoRA the reference is the policy with its
    adapter disabled: no second copy in memory."""
    p = cfg.ppo
    dtype = resolve_dtype(cfg.model.dtype, cfg.device.accelerator)
    policy_dir = require_dir(p.policy_dir, "SFT policy (ppo.policy_dir)", "rlhf sft")
    reward_dir = require_dir(p.reward_dir, "reward model (ppo.reward_dir)", "rlhf reward", marker="config.json")
    rm_tok = load_tokenizer(reward_dir, cfg.model)
    if not same_vocab(tok, rm_tok):
        raise RlhfError(f"the reward model's tokenizer ({reward_dir}) differs from the policy's ({policy_dir}); "
                        "train the reward model from the same base (rlhf reward) or point ppo.reward_dir at one")

    policy = load_policy_base(policy_dir, dtype, cfg.model)
    ref = None
    if p.lora.enabled:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora_config(p.lora, "CAUSAL_LM"))
    else:
        ref = copy.deepcopy(policy).eval().requires_grad_(False).to(device)
    policy.generation_config.pad_token_id = tok.pad_token_id

    value_src = {"reward": reward_dir, "sft": policy_dir}.get(str(p.value_init))
    if value_src is None:
        value_src = base_model_dir(cfg) if str(p.value_init) == "base" else \
            require_dir(p.value_init, "value model init (ppo.value_init)", "rlhf reward")
    value = load_seq_cls(value_src, tok, dtype, cfg.model)
    stats_file = reward_dir / "score_stats.json"
    stats = read_json(stats_file) if stats_file.exists() else None
    if p.normalize_scores and stats is None:
        log.warning("ppo: %s has no score_stats.json; scores are not normalised", reward_dir)
    if p.normalize_scores and stats is not None and str(p.value_init) == "reward":
        # The returns are built from normalised scores; a value head copied from the RM predicts raw scores,
        # std times too large, and its first advantages would be noise. Rescale the head to the same units.
        with torch.no_grad():
            TokenValueModel(value).head.weight.div_(float(stats["std"]))
    if p.value_lora:
        from peft import get_peft_model

        value = get_peft_model(value, lora_config(p.lora, "SEQ_CLS"))
    reward = load_seq_cls(reward_dir, tok, dtype, cfg.model).eval().requires_grad_(False)
    # Dropout off everywhere: the old log-probs come from sampling in eval mode, and the first ratio must be 1.
    return (policy.to(device).eval(), ref, TokenValueModel(value).to(device).eval(),
            TokenValueModel(reward).to(device).eval(), stats, value_src)


# ------------------------------------------------------------------------------------------------ prompts
class PromptStream:
    """Repeating, shuffled prompt stream; each process takes a disjoint shard. Its position is a checkpoint
    counter, so a resumed run continues with the prompts it would have seen."""

    def __init__(self, prompts: list[str], seed: int, rank: int, world: int) -> None:
        self.prompts, self.seed, self.rank, self.world = prompts, seed, rank, world
        self.consumed = 0  # prompts taken by this process so far

    def _order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.prompts)))
        random.Random(self.seed + epoch).shuffle(idx)
        return idx[self.rank:: self.world] or idx

    def take(self, n: int) -> list[str]:
        out = []
        while len(out) < n:
            shard_epoch, pos = divmod(self.consumed, len(self._order(0)))
            order = self._order(shard_epoch)
            take = min(n - len(out), len(order) - pos)
            out.extend(self.prompts[i] for i in order[pos: pos + take])
            self.consumed += take
        return out


# ------------------------------------------------------------------------------------------------ rollout
@torch.no_grad()
def rollout(prompts: list[str], tok, policy, ref, value_model, reward_model, p, stats, gen_config, stop_ids,
            device) -> Rollout:
    """Steps 1 and 2: generate in chunks of `rollout_forward_batch_size`, then score the chunk."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    chunks = []
    fwd = int(p.rollout_forward_batch_size)
    fixed = None if stop_ids else int(p.response_length)
    for i in range(0, len(prompts), fwd):
        q_ids = enc["input_ids"][i: i + fwd].to(device)
        q_mask = enc["attention_mask"][i: i + fwd].to(device)
        g = generate_chunk(policy, tok, q_ids, q_mask, gen_config, stop_ids, float(p.temperature), fixed)
        resp, rmask = g["response"], g["mask"]
        R = resp.shape[1]
        input_ids = torch.cat([q_ids, resp], 1)
        attn = torch.cat([q_mask, rmask.long()], 1)
        pos = position_ids_from(attn)
        # reference: the same weights with the adapter disabled (or the explicit copy for full fine-tuning)
        ctx = policy.disable_adapter() if ref is None else contextlib.nullcontext()
        with ctx:
            ref_logits = policy_logits(ref if ref is not None else policy, input_ids, attn, pos, R)
        # divided in place (the same numbers as passing the temperature): one (B, R, V) buffer less at the peak
        ref_logprobs = core.logprobs_from_logits(ref_logits.div_(float(p.temperature)), resp, 1.0)
        del ref_logits
        values = response_slice(value_model(input_ids, attn, pos), R)
        last = q_ids.shape[1] + core.last_token_index(rmask)
        rm_scores = reward_model.score_at(input_ids, attn, pos, last)
        has_stop = torch.isin(resp, torch.tensor(stop_ids, device=device)).any(-1) if stop_ids \
            else torch.zeros(resp.shape[0], dtype=torch.bool, device=device)
        texts = tok.batch_decode(resp, skip_special_tokens=True)
        empty = torch.tensor([not t.strip() for t in texts], device=device)
        scores = rm_scores.clone()
        if p.normalize_scores and stats is not None:
            scores = (scores - float(stats["mean"])) / float(stats["std"])
        if p.missing_eos_penalty is not None and stop_ids:
            scores = torch.where(has_stop, scores, scores - float(p.missing_eos_penalty))
        if p.empty_response_penalty is not None:
            scores = torch.where(empty, torch.full_like(scores, float(p.empty_response_penalty)), scores)
        chunks.append(Rollout(input_ids=input_ids, attention_mask=attn, position_ids=pos, response_ids=resp,
                              response_mask=rmask, logprobs=g["logprobs"], ref_logprobs=ref_logprobs,
                              values=values, scores=scores, rm_scores=rm_scores, has_stop=has_stop, empty=empty,
                              entropy=g["entropy"]))
    return Rollout.cat(chunks).trim()


# ------------------------------------------------------------------------------------------------- checkpoints
def save_policy(policy, path: Path) -> None:
    """The adapter (embeddings are never trained, so a LoRA on a tied output layer saves only its A and B), or
    the full model."""
    if hasattr(policy, "peft_config"):
        policy.save_pretrained(str(path), save_embedding_layers=False)
    else:
        policy.save_pretrained(str(path))


def save_checkpoint(path: Path, policy, value_model, tok, state: dict) -> None:
    """Adapter (or full policy), value model, tokenizer and trainer state, written atomically."""
    from rlhf_cli.io import atomic_dir

    with atomic_dir(path, every_rank=False) as tmp:  # the main process alone writes checkpoints
        save_policy(policy, tmp)
        tok.save_pretrained(str(tmp))
        value_model.model.save_pretrained(str(tmp / "value"))
        torch.save(state, tmp / STATE_FILE)


def latest_checkpoint(work: Path) -> Path | None:
    ckpts = sorted((work / "checkpoints").glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def rng_state() -> dict:
    s = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def prepare_work_dir(out: Path, resume: bool) -> Path:
    """The hidden directory a run is built in. resume=true continues a partial run, or a finished one."""
    work = out.parent / f".{out.name}.partial"
    if resume:
        if not work.exists() and out.exists():
            shutil.copytree(out, work)
        if not work.exists():
            raise RlhfError(f"ppo.resume=true but there is no run to resume at {out} or {work}; drop resume=true")
        return work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def publish(work: Path, out: Path) -> None:
    """Swap the finished work directory into place (old output moved aside, then deleted)."""
    old = out.parent / f".{out.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    work.rename(out)
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------------- run
def run(cfg) -> None:
    setup_torch(cfg)
    from accelerate import Accelerator
    from torch.utils.tensorboard import SummaryWriter
    from tqdm.auto import tqdm
    from transformers import GenerationConfig, get_scheduler

    p = cfg.ppo
    accelerator = Accelerator(cpu=cfg.device.accelerator == "cpu")
    device, world, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    sizes = ppo_sizes(p, world)
    if p.kl_estimator not in ("k1", "k3", "abs", "mse"):
        raise RlhfError(f"ppo.kl_estimator={p.kl_estimator} is unknown; use k1, k3, abs or mse")
    if float(p.temperature) <= 0:
        raise RlhfError(f"ppo.temperature must be > 0 (got {p.temperature}); sampling and scoring share it")

    # ---- models, tokenizer, prompts
    policy_dir = require_dir(p.policy_dir, "SFT policy (ppo.policy_dir)", "rlhf sft")
    tok = load_tokenizer(policy_dir, cfg.model)
    policy, ref, value_model, reward_model, stats, value_src = build_models(cfg, tok, device)
    thinking = bool(cfg.model.enable_thinking)
    templ = bool(cfg.data.chat_template)
    train, _ = D.load_examples(cfg.data, need_rejected=False)
    train = D.filter_long_prompts(train, tok, int(cfg.data.max_prompt_length), str(cfg.data.train_path), thinking, templ)
    prompts = [D.prompt_text(tok, ex.prompt, thinking, templ) for ex in train]
    stream = PromptStream(prompts, int(cfg.seed), rank, world)

    stop_ids = []
    if p.stop_token == "eos":
        stop_ids = [tok.eos_token_id, *[int(i) for i in p.stop_token_ids]]
    elif p.stop_token is not None:
        raise RlhfError(f"ppo.stop_token={p.stop_token} is unknown; use eos, or null for fixed-length responses")
    gen_config = GenerationConfig(
        max_new_tokens=int(p.response_length), do_sample=True, temperature=float(p.temperature),
        top_k=int(p.top_k), top_p=float(p.top_p), pad_token_id=tok.pad_token_id,
        eos_token_id=stop_ids or tok.eos_token_id, use_cache=True,
        return_dict_in_generate=True, output_logits=True,
        # no stop token: EOS is masked while sampling so every response has exactly response_length tokens
        min_new_tokens=0 if stop_ids else int(p.response_length))

    # ---- optimizer: one AdamW, two parameter groups (policy, value) with their own learning rates
    value_lr = float(p.value_learning_rate if p.value_learning_rate is not None else p.learning_rate)
    pol_params = [q for q in policy.parameters() if q.requires_grad]
    val_params = [q for q in value_model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW([{"params": pol_params, "lr": float(p.learning_rate)},
                                   {"params": val_params, "lr": value_lr}],
                                  lr=float(p.learning_rate), weight_decay=float(p.weight_decay), eps=1e-5)
    total_steps = sizes.num_updates * int(p.num_ppo_epochs) * sizes.num_mini_batches
    scheduler = get_scheduler(str(p.lr_scheduler_type), optimizer,
                              num_warmup_steps=int(float(p.warmup_ratio) * total_steps),
                              num_training_steps=total_steps)
    policy, value_model, optimizer = accelerator.prepare(policy, value_model, optimizer)
    if world > 1:
        # weights are already in sync (DDP broadcasts rank 0's); sampling must differ between ranks
        torch.manual_seed(int(cfg.seed) + rank)
    unwrapped = accelerator.unwrap_model(policy)
    kl_ctl = (core.AdaptiveKLController(float(p.kl_coef), float(p.target_kl_value), float(p.kl_horizon))
              if p.adaptive_kl else core.FixedKLController(float(p.kl_coef)))

    def allreduce_sum(t: torch.Tensor) -> torch.Tensor:
        return accelerator.reduce(t, "sum") if world > 1 else t

    def global_mean(t: torch.Tensor) -> torch.Tensor:
        return accelerator.reduce(t.float().mean(), "mean") if world > 1 else t.float().mean()

    # ---- output / resume
    out = Path(p.output_dir)
    if accelerator.is_main_process:
        prepare_work_dir(out, bool(p.resume))
    accelerator.wait_for_everyone()
    work = out.parent / f".{out.name}.partial"
    start_update, episodes = 0, 0
    if p.resume:
        ckpt = latest_checkpoint(work)
        if ckpt is None:
            raise RlhfError(f"ppo.resume=true but {work}/checkpoints holds no checkpoint; drop resume=true")
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = torch.load(ckpt / STATE_FILE, weights_only=False)
        if p.lora.enabled:
            set_peft_model_state_dict(unwrapped, load_file(str(ckpt / "adapter_model.safetensors")))
        else:
            unwrapped.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
        vm = accelerator.unwrap_model(value_model).model
        vfile = ckpt / "value" / ("adapter_model.safetensors" if p.value_lora else "model.safetensors")
        if p.value_lora:
            set_peft_model_state_dict(vm, load_file(str(vfile)))
        else:
            vm.load_state_dict(load_file(str(vfile)), strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        kl_ctl.load_state_dict(state["kl_ctl"])
        start_update, episodes = state["update"], state["episodes"]
        stream.consumed = state["prompts_consumed"][rank] if world > 1 else state["prompts_consumed"][0]
        set_rng_state(state["rng"][rank] if len(state["rng"]) > rank else state["rng"][0])
        log.info("ppo: resumed from %s at update %d (%d episodes)", ckpt, start_update, episodes)

    writer = SummaryWriter(str(work / "tensorboard")) if accelerator.is_main_process else None
    gt_check = None
    if cfg.data.get("ground_truth") == "demo_polite":
        from rlhf_cli.demo import is_polite as gt_check
    log.info("ppo: %d updates × %d episodes (%d process(es) × %d micro × %d accumulation × %d mini-batches), "
             "%d PPO epochs, response_length %d, lr %g, kl_coef %g; value model from %s",
             sizes.num_updates, sizes.batch_size, world, sizes.micro_batch_size, sizes.gradient_accumulation_steps,
             sizes.num_mini_batches, int(p.num_ppo_epochs), int(p.response_length), float(p.learning_rate),
             float(p.kl_coef), value_src)
    bar = tqdm(total=sizes.num_updates * sizes.batch_size, initial=episodes, unit="ep", desc="ppo",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    t_start = time.perf_counter()
    metrics = {}

    for update in range(start_update + 1, sizes.num_updates + 1):
        t0 = time.perf_counter()
        # step 1 + 2. sample and score
        batch = rollout(stream.take(sizes.local_batch_size), tok, unwrapped, ref, value_model, reward_model,
                        p, stats, gen_config, stop_ids, device)
        mask = batch.response_mask
        if update == 1 and not p.resume:
            first_kl = core.masked_mean((batch.logprobs - batch.ref_logprobs).abs(), mask,
                                        allreduce_sum=allreduce_sum)
            if first_kl.item() > float(p.first_update_kl_tolerance):
                raise RlhfError(
                    f"KL(policy||reference) is {first_kl.item():.3g} per token before any update (expected ≈ 0): "
                    "the reference is not the starting policy. Check that ppo.policy_dir is a plain SFT model "
                    "and that sampling and scoring use the same temperature")
        t_gen = time.perf_counter() - t0

        # step 3. rewards: KL penalty on every token, the score on the last response token
        rewards, kl = core.token_rewards(batch.scores, batch.logprobs, batch.ref_logprobs, mask, kl_ctl.value,
                                         estimator=str(p.kl_estimator))
        if p.whiten_rewards:
            rewards = core.masked_whiten(rewards, mask, keep_mean=True, allreduce_sum=allreduce_sum)
        # step 4. advantages (GAE), whitened with statistics over all processes
        advantages, returns = core.gae(rewards, batch.values, mask, float(p.gamma), float(p.lam))
        advantages = core.masked_whiten(advantages, mask, allreduce_sum=allreduce_sum)

        # step 5. PPO epochs
        stat_keys = ("pg_loss", "vf_loss", "approxkl", "clipfrac", "vf_clipfrac", "entropy", "ratio")
        acc = {k: [] for k in stat_keys}
        R = batch.response_ids.shape[1]
        policy.train()
        value_model.train()
        unwrapped.eval()  # modules stay in eval mode (no dropout); train() above only flags DDP
        accelerator.unwrap_model(value_model).eval()
        stop_early = False
        for _epoch in range(int(p.num_ppo_epochs)):
            perm = torch.randperm(sizes.local_batch_size, device=device)
            # per micro-batch, the prompt padding shared by all its rows is skipped (one host sync per epoch)
            starts = leading_padding(batch.attention_mask[perm], sizes.micro_batch_size)
            for mb in range(sizes.num_mini_batches):
                mb_idx = perm[mb * sizes.local_mini_batch_size: (mb + 1) * sizes.local_mini_batch_size]
                mb_stats = []
                for k in range(sizes.gradient_accumulation_steps):
                    idx = mb_idx[k * sizes.micro_batch_size: (k + 1) * sizes.micro_batch_size]
                    last_micro = k == sizes.gradient_accumulation_steps - 1
                    sync = contextlib.ExitStack()
                    if not last_micro and world > 1:
                        # gradients are all-reduced once per optimizer step, on the last micro-batch
                        sync.enter_context(accelerator.no_sync(policy))
                        sync.enter_context(accelerator.no_sync(value_model))
                    with sync:
                        s0 = starts[mb * sizes.gradient_accumulation_steps + k]
                        ids, am = batch.input_ids[idx, s0:], batch.attention_mask[idx, s0:]
                        pos = batch.position_ids[idx, s0:]
                        m = mask[idx]
                        logits = policy_logits(policy, ids, am, pos, R)
                        # the entropy keeps its graph only when it is a loss term (ppo.ent_coef)
                        new_logprobs, tok_entropy = core.logprobs_and_entropy(
                            logits, batch.response_ids[idx], float(p.temperature), entropy_grad=bool(float(p.ent_coef)))
                        vpred = response_slice(value_model(ids, am, pos), R)
                        pg_loss, pg_stats = core.policy_loss(new_logprobs, batch.logprobs[idx], advantages[idx], m,
                                                             float(p.cliprange))
                        vf_loss, vf_stats = core.value_loss(vpred, batch.values[idx], returns[idx], m,
                                                            float(p.cliprange_value))
                        loss = pg_loss + float(p.vf_coef) * vf_loss
                        ent_term = core.masked_mean(tok_entropy, m)
                        ent = ent_term.detach()
                        if float(p.ent_coef):
                            loss = loss - float(p.ent_coef) * ent_term
                        accelerator.backward(loss / sizes.gradient_accumulation_steps)
                    mb_stats.append(torch.stack([pg_loss.detach(), vf_loss.detach(), pg_stats["approxkl"],
                                                 pg_stats["clipfrac"], vf_stats["clipfrac"], ent, pg_stats["ratio"]]))
                if p.max_grad_norm:
                    accelerator.clip_grad_norm_(pol_params + val_params, float(p.max_grad_norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                s = torch.stack(mb_stats).mean(0)
                for key, v in zip(stat_keys, s):
                    acc[key].append(v)
                if p.target_kl is not None and global_mean(s[2]).item() > float(p.target_kl):
                    stop_early = True
                    break
            if stop_early:
                break
        policy.eval()
        value_model.eval()

        # step 6. metrics (global means), log, samples, checkpoint
        episodes += sizes.batch_size
        seq_kl = kl.sum(-1)
        non_score = (-kl_ctl.value * kl).sum(-1)
        vstats = core.value_loss(batch.values, batch.values, returns, mask, float(p.cliprange_value))[1]
        length = mask.sum(-1)
        m = {
            "objective/scores": global_mean(batch.scores),
            "objective/rm_scores": global_mean(batch.rm_scores),
            "objective/kl": global_mean(seq_kl),
            "objective/entropy": global_mean(core.masked_sum(batch.entropy, mask, dim=-1)),
            "objective/non_score_reward": global_mean(non_score),
            "objective/rlhf_reward": global_mean(batch.scores + non_score),
            "policy/approxkl_avg": global_mean(torch.stack(acc["approxkl"])),
            "policy/clipfrac_avg": global_mean(torch.stack(acc["clipfrac"])),
            "policy/entropy_avg": global_mean(torch.stack(acc["entropy"])),
            "loss/policy_avg": global_mean(torch.stack(acc["pg_loss"])),
            "loss/value_avg": global_mean(torch.stack(acc["vf_loss"])),
            "val/clipfrac_avg": global_mean(torch.stack(acc["vf_clipfrac"])),
            "val/explained_var": global_mean(vstats["explained_var"]),
            "val/ratio": global_mean(torch.stack(acc["ratio"])),
            "val/num_eos_tokens": accelerator.reduce(batch.has_stop.float().sum(), "sum") if world > 1
            else batch.has_stop.float().sum(),
            "response/length_mean": global_mean(length),
            "response/empty_rate": global_mean(batch.empty.float()),
        }
        texts = tok.batch_decode(batch.response_ids, skip_special_tokens=True)
        if gt_check is not None:
            m["objective/ground_truth_rate"] = global_mean(torch.tensor([float(gt_check(t)) for t in texts]))
        metrics = {k: float(v) for k, v in m.items()}
        elapsed = time.perf_counter() - t0
        metrics.update({"lr": scheduler.get_last_lr()[0], "kl_coef": float(kl_ctl.value),
                        "eps": sizes.batch_size / elapsed, "time/rollout_s": t_gen, "time/update_s": elapsed,
                        "episodes": episodes})
        kl_ctl.update(metrics["objective/kl"], sizes.batch_size)
        bar.update(sizes.batch_size)
        if accelerator.is_main_process:
            for k, v in metrics.items():
                writer.add_scalar(k, v, episodes)
            if update % max(int(p.logging_steps), 1) == 0 or update == sizes.num_updates:
                gt = f" gt {metrics['objective/ground_truth_rate']:.2f}" if gt_check else ""
                bar.write(f"update {update}/{sizes.num_updates} ep {episodes} score {metrics['objective/scores']:+.2f}"
                          f" kl {metrics['objective/kl']:.2f}{gt} len {metrics['response/length_mean']:.1f}"
                          f" pg {metrics['loss/policy_avg']:+.3f} vf {metrics['loss/value_avg']:.3f}"
                          f" clip {metrics['policy/clipfrac_avg']:.2f} eps {metrics['eps']:.1f}")
            if p.sample_every and (update % int(p.sample_every) == 0 or update == 1):
                q = tok.batch_decode(batch.input_ids[:4, : batch.context_length], skip_special_tokens=True)
                rows = [f"| {qq.strip()!r} | {rr.strip()!r} | {sc:+.2f} |"
                        for qq, rr, sc in zip(q, texts[:4], batch.scores[:4].tolist())]
                writer.add_text("samples", "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows),
                                episodes)
        save_now = update == sizes.num_updates or (int(p.save_every) and update % int(p.save_every) == 0)
        if save_now:
            consumed = [torch.tensor([stream.consumed], device=device)]
            rngs = [rng_state()]
            if world > 1:
                consumed = accelerator.gather(consumed[0]).tolist()
                import torch.distributed as dist

                rngs = [None] * world
                dist.all_gather_object(rngs, rng_state())
            else:
                consumed = [stream.consumed]
            if accelerator.is_main_process:
                state = {"update": update, "episodes": episodes, "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "kl_ctl": kl_ctl.state_dict(),
                         "prompts_consumed": consumed, "rng": rngs, "metrics": metrics}
                save_checkpoint(work / "checkpoints" / f"checkpoint-{update}", unwrapped,
                                accelerator.unwrap_model(value_model), tok, state)
            accelerator.wait_for_everyone()
    bar.close()

    # ---- final outputs: adapter + tokenizer at the top, value model, optional merged model; then publish
    if accelerator.is_main_process:
        save_policy(unwrapped, work)
        tok.save_pretrained(str(work))
        accelerator.unwrap_model(value_model).model.save_pretrained(str(work / "value"))
        if p.merge and p.lora.enabled:
            merged = merge_lora(copy.deepcopy(unwrapped))
            merged.save_pretrained(str(work / "merged"))
            tok.save_pretrained(str(work / "merged"))
        total = time.perf_counter() - t_start
        summary = {**metrics, "updates": sizes.num_updates, "total_episodes": episodes,
                   "train_seconds": round(total, 2), "world_size": world,
                   "policy_dir": str(Path(p.policy_dir).resolve()), "reward_dir": str(Path(p.reward_dir).resolve())}
        write_json(work / "metrics.json", summary)
        writer.close()
        publish(work, out)
        log.info("ppo: %d episodes in %.1f s; wrote %s", episodes, total, out)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if not math.isfinite(metrics.get("objective/scores", 0.0)):
        raise RlhfError("ppo: scores became NaN/inf; lower ppo.learning_rate")
