"""The PPO hyper-parameters as one typed object, built once from the `ppo` config group (values are validated
by `rlhf_cli.schema` when the config is composed; here they get their types, and `check` tests the keys that
only make sense together)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlhf_cli.errors import RlhfError

# Sampling with a LoRA policy merges W + B·A into a copy of each adapted weight (rollout.lora_merged). On a CPU that
# copy, once per rollout, outweighs the adapter's small per-step matmuls when the weights are large: Qwen3-0.6B's
# shape in fp32 (1.76 GB adapted), 8 x 32 tokens, 1 thread, 3 samplings each: merged 24.9 / 20.4 / 19.8 s (the
# first pays ~5 s of fresh pages), unmerged 19.6 / 19.7 / 19.5 s. Small models merge (fewer ops per step is what
# counts there); on a GPU the copy is cheap and they always merge. Rerun: bench/merge_probe.py.
CPU_MERGE_MAX_BYTES = 256 * 2**20
# Scoring forwards run micro-batches of rows grouped by prompt length only where one forward over the rollout chunk
# would hold more fp32 logits than this (bench, 1 thread: Qwen3-0.6B's shape, 8 rows x 32 tokens x 151,936 = 155 MB,
# scoring 20.0 -> 16.9 s per update grouped; tiny / mini, <= 3 MB, grouped 25-30% slower; mid, 12 MB, even).
SCORE_GROUPS_FROM_BYTES = 64 * 2**20

ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp")
GROUP_ADVANTAGES = ("grpo", "rloo")   # compare the responses to one prompt: samples_per_prompt ≥ 2
REWARD_MODEL = "model"                # the ppo.reward entry that means the reward model at ppo.reward_dir


@dataclass(frozen=True)
class PPOConfig:
    # optimisation
    learning_rate: float
    value_learning_rate: float | None   # None: learning_rate
    lr_scheduler_type: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float | None         # None / 0: no clipping
    sparse_value_embedding: bool        # a fully trained value model's embedding: AdamW over the rows tokens reach
    num_ppo_epochs: int
    # sampling
    response_length: int
    temperature: float
    top_k: int
    top_p: float
    stop_token: str | None              # "eos" or None (fixed-length responses)
    stop_token_ids: tuple[int, ...]
    recompute_logprobs: str             # auto | true | false
    # rewards and advantages
    reward: tuple[str, ...]             # "model" and/or "module:function" / "/path/file.py:function", summed
    reward_weights: tuple[float, ...] | None  # one per reward source; None: 1 each
    advantage: str                      # gae | grpo | rloo | reinforce_pp
    samples_per_prompt: int             # n responses per prompt (each prompt of an update repeated n times)
    scale_rewards: bool                 # grpo: divide by the group's std (false: Dr. GRPO)
    loss_aggregation: str               # token_mean | sequence_mean
    kl_loss_estimator: str              # grpo: the KL estimate in its loss
    # reward shaping and KL
    kl_coef: float
    kl_estimator: str                   # k1 | k3 | abs | mse (where the KL is a reward: gae, rloo, reinforce_pp)
    adaptive_kl: bool
    adaptive_kl_target: float           # nats per sequence, for the adaptive controller
    kl_horizon: float
    whiten_rewards: bool
    normalize_scores: bool
    missing_eos_penalty: float | None
    empty_response_penalty: float | None
    first_update_kl_tolerance: float | None  # None: by compute precision
    # losses
    gamma: float
    lam: float
    cliprange: float
    cliprange_value: float
    vf_coef: float
    ent_coef: float
    target_kl: float | None             # stop an update's epochs early when approxkl exceeds this
    # run
    logging_steps: int
    sample_every: int
    save_every: int

    @classmethod
    def from_cfg(cls, p) -> PPOConfig:
        """From the `ppo` group (a DictConfig or mapping); each value cast to its field's type."""
        kw = {}
        for f in fields(cls):
            v = p[f.name]
            t = str(f.type)
            if v is None:
                kw[f.name] = None
            elif f.name == "recompute_logprobs":
                kw[f.name] = str(v).lower()
            elif t.startswith("tuple"):
                item = {"str": str, "float": float}.get(t[len("tuple["):].split(",")[0], int)
                kw[f.name] = (item(v),) if isinstance(v, (str, int, float)) else tuple(item(i) for i in v)
            elif t.startswith("float"):
                kw[f.name] = float(v)
            elif t.startswith("int"):
                kw[f.name] = int(v)
            elif t.startswith("bool"):
                kw[f.name] = bool(v)
            else:
                kw[f.name] = str(v)
        return cls(**kw)

    @property
    def value_lr(self) -> float:
        return self.learning_rate if self.value_learning_rate is None else self.value_learning_rate

    @property
    def critic(self) -> bool:
        """A value model is trained (gae); the other estimators need none, so none is loaded or saved."""
        return self.advantage == "gae"

    @property
    def uses_reward_model(self) -> bool:
        return REWARD_MODEL in self.reward

    def weights(self) -> tuple[float, ...]:
        """One weight per `reward` entry."""
        return self.reward_weights if self.reward_weights is not None else (1.0,) * len(self.reward)

    def check(self, local_batch_size: int) -> None:
        """Keys that are only wrong together: one error naming them and the fix."""
        if self.advantage not in ADVANTAGES:
            raise RlhfError(f"ppo.advantage={self.advantage} is unknown; use one of {', '.join(ADVANTAGES)}")
        n = self.samples_per_prompt
        if self.advantage in GROUP_ADVANTAGES and n < 2:
            raise RlhfError(f"ppo.advantage={self.advantage} compares the responses to one prompt, but "
                            f"ppo.samples_per_prompt={n}; set ppo.samples_per_prompt=4 (any value ≥ 2)")
        if local_batch_size % n:
            raise RlhfError(f"ppo.samples_per_prompt={n} does not divide the per-process batch of "
                            f"{local_batch_size} episodes (per_device_train_batch_size × gradient_accumulation_steps "
                            "× num_mini_batches); pick a divisor of it")
        if not self.reward:
            raise RlhfError("ppo.reward is empty; use [model] (the reward model) and/or functions "
                            "[module:function, /path/file.py:function]")
        if len(set(self.reward)) < len(self.reward):
            raise RlhfError(f"ppo.reward lists a source twice ({', '.join(self.reward)}); give it once with a weight")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise RlhfError(f"ppo.reward_weights has {len(self.reward_weights)} value(s) for {len(self.reward)} "
                            f"reward source(s) ({', '.join(self.reward)}); give one weight per source, or null")
