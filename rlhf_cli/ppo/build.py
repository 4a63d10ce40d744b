"""PPO assembled in one place: the models `rlhf ppo` trains and reads, loaded through `rlhf_cli.models` and given
the speed paths of `rlhf_cli.accel` (when the config turns them on)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlhf_cli.accel import FastPaths
from rlhf_cli.config import require_dir
from rlhf_cli.errors import RlhfError
from rlhf_cli.io import read_json
from rlhf_cli.models import check_vocab, fp32_trainables, load_policy, load_seq_cls, lora_config, quantization_config
from rlhf_cli.ppo.config import REWARD_MODEL
from rlhf_cli.ppo.forward import TokenValueModel
from rlhf_cli.ppo.reward_model import load_reward_model, own_tokenizer, refuse_value_from
from rlhf_cli.ppo.shard import Placement, checkpoint_layers
from rlhf_cli.sources import base_model_dir

log = logging.getLogger("rlhf")


@dataclass
class PPOModels:
    policy: torch.nn.Module        # trainable: a PEFT LoRA model (reference = adapter disabled) or a full model
    ref: torch.nn.Module | None    # None: the policy with its adapter disabled; else a frozen copy
    value: torch.nn.Module | None  # TokenValueModel, trainable (all weights, or LoRA + head); None: critic-free
    reward: torch.nn.Module | None  # TokenValueModel, frozen; None: rewarded by functions alone
    score_stats: dict | None       # the reward model's score mean / std (for normalisation), or None
    value_source: str              # where the value model came from (for the log)
    # called once with the optimizer, before its first step (parameters a speed path trains beside the models')
    on_optimizer: list[Callable[[torch.optim.Optimizer], None]] = field(default_factory=list)


def build_ppo_models(run, tok, device, storage: torch.dtype, paths: FastPaths | None = None,
                     world: int = 1) -> PPOModels:
    """`PPOModels` for `rlhf ppo`: the SFT policy with a fresh LoRA adapter (its adapter-disabled self is the
    reference; full fine-tuning gets a frozen copy instead), the value model (gae only: from the reward model,
    the SFT policy, the base or a directory; all weights trained, or LoRA + score head on a frozen trunk) and the
    frozen reward model (only when `ppo.reward` names it: a run rewarded by functions alone needs no
    ppo.reward_dir). Frozen weights are stored in `storage`, their decoder layers quantized with
    `model.quantization` (the LoRA policy's base, so the reference too; a LoRA value trunk; the reward model);
    trainable ones in fp32. `paths`: the speed paths to install (None: none); `world`: the number of processes.
    `run`: the run's settings (rlhf_cli.settings.of, or the composed config)."""
    p = run.ppo
    sources = [p.reward] if isinstance(p.reward, str) else list(p.reward)
    use_rm = REWARD_MODEL in sources
    policy_dir = require_dir(p.policy_dir, "SFT policy (ppo.policy_dir)", "rlhf sft")
    check_context(run, policy_dir)
    reward_dir = rm_tok = None
    if use_rm:
        reward_dir = require_dir(p.reward_dir, "reward model (ppo.reward_dir)", "rlhf reward", marker="config.json")
        rm_tok = own_tokenizer(reward_dir, tok, run)  # None: it reads the policy's token ids
        if rm_tok is not None and str(p.advantage) == "gae" and str(p.value_init) == "reward":
            raise refuse_value_from(reward_dir)
    place = Placement.of(run, device)
    quant = quantization_config(run)  # rlhf_cli.quantization refused it with a full fine-tune or sharding
    policy, ref = _policy(run, tok, policy_dir, device, storage, quant)
    if p.activation_checkpointing:  # before sharding: FSDP gathers a layer for its recomputation as for its backward
        checkpoint_layers(policy)
    if place.sharded:  # each model sharded as soon as it is built: never two whole models in one process
        fp32_trainables(policy)
        policy, ref = place(policy), place(ref)
    stats = None
    if use_rm:
        stats_file = reward_dir / "score_stats.json"
        stats = read_json(stats_file) if stats_file.exists() else None
        if p.normalize_scores and stats is None:
            log.warning("ppo: %s has no score_stats.json; scores are not normalised", reward_dir)
    value, value_src = None, f"nowhere (ppo.advantage={p.advantage} has no critic)"
    if str(p.advantage) == "gae":
        value, value_src = _value(run, tok, place.load_device, storage, policy_dir, reward_dir, stats,
                                  quant if p.value_lora else None)
        if p.activation_checkpointing:
            checkpoint_layers(value)
        value = place(value)
    reward = load_reward_model(reward_dir, tok, storage, run, device, rm_tok, quant) if use_rm else None
    reward = place(reward)
    fp32_trainables(policy)
    models = PPOModels(policy=policy, ref=ref, value=value, reward=reward, score_stats=stats,
                       value_source=str(value_src))
    if paths is not None:
        paths.install(policy, ref, value, getattr(reward, "scorer", reward))
        emb = paths.value_embedding(value, world, float(p.weight_decay))
        if emb is not None:
            models.on_optimizer.append(emb.attach)
    # Dropout off everywhere: the old log-probs come from sampling in eval mode, and the first ratio must be 1.
    models.policy = policy.to(device).eval()
    return models


def check_context(run, policy_dir) -> None:
    """Prompt + response must fit the model's positions: checked before any weight loads, so that an absurd
    `ppo.response_length` is a line, not an allocator failure. `run`: the run's settings."""
    config = policy_dir / "config.json"
    limit = read_json(config).get("max_position_embeddings") if config.is_file() else None
    need = int(run.ppo.response_length) + int(run.data.max_prompt_length)
    if limit and need > int(limit):
        raise RlhfError(f"ppo.response_length={run.ppo.response_length} + data.max_prompt_length="
                        f"{run.data.max_prompt_length} = {need} positions, more than the {limit} the policy has "
                        f"({config}); lower ppo.response_length")


def _policy(run, tok, policy_dir, device, storage, quant=None):
    """(policy, ref): the SFT model (`quant`: its decoder quantized) with a fresh LoRA adapter and no separate
    reference, or (full fine-tuning) the model in fp32 and a frozen copy as the reference."""
    p = run.ppo
    lora = bool(p.lora.enabled)
    policy = load_policy(policy_dir, storage if lora else torch.float32, run.model, merge=True,
                         quant=quant if lora else None)
    check_vocab(tok, policy, policy_dir)
    ref = None
    if lora:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora_config(p.lora, "CAUSAL_LM"))
    else:
        ref = copy.deepcopy(policy).to(storage).eval().requires_grad_(False).to(device)
    policy.generation_config.pad_token_id = tok.pad_token_id
    return policy, ref


def _value(run, tok, device, storage, policy_dir, reward_dir, stats, quant=None):
    """(value model as a TokenValueModel, where it came from) for `ppo.value_init`; `quant`: a LoRA value
    model's frozen trunk quantized."""
    p = run.ppo
    init = str(p.value_init)
    if init == "reward" and reward_dir is None:
        log.info("ppo: ppo.reward has no reward model; the value model starts from the SFT policy")
        init = "sft"
    src = {"reward": reward_dir, "sft": policy_dir}.get(init)
    if src is None:
        src = base_model_dir(run) if init == "base" else \
            require_dir(p.value_init, "value model init (ppo.value_init)", "rlhf reward")
    value = load_seq_cls(src, tok, storage if p.value_lora else torch.float32, run.model,
                         trained_head=init == "reward", quant=quant)
    if p.normalize_scores and stats is not None and init == "reward":
        # The returns are built from normalised scores; a value head copied from the RM predicts raw scores,
        # std times too large, and its first values would be noise. Rescale the head to the same units.
        with torch.no_grad():
            TokenValueModel(value).head.weight.div_(float(stats["std"]))
    if p.value_lora:
        from peft import get_peft_model

        value = get_peft_model(value, lora_config(p.lora, "SEQ_CLS"))
    fp32_trainables(value)
    return TokenValueModel(value).to(device).eval(), src
