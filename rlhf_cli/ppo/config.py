"""The PPO hyper-parameters as one typed object, built once from the `ppo` config group by `from_cfg`.

Each field is a key of the `ppo` group: its type, range, allowed values and meaning are written once, in
`rlhf_cli.keys.SCHEMA["ppo.<field>"]` (checked when the config is composed); `from_cfg` casts by that
entry's kind (`rlhf_cli.settings.cast`: `recompute_logprobs`, true / false / auto, becomes lower-case text), and
tests/test_ppo_config.py checks that the fields are exactly the schema's `ppo.*` keys less `NOT_FIELDS`, typed as
the schema says. `check` tests the keys that only make sense together."""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlhf_cli.choices import ADVANTAGES, REWARD_MODEL
from rlhf_cli.errors import RlhfError
from rlhf_cli.keys import SCHEMA
from rlhf_cli.settings import cast

GROUP_ADVANTAGES = ("grpo", "rloo")   # compare the responses to one prompt: samples_per_prompt ≥ 2
# ppo.* keys that are not fields: batch sizes (rlhf_cli.config.ppo_sizes), model sources and LoRA
# (rlhf_cli.models.build_ppo_models), how a reward server is asked (rlhf_cli.ppo.rewards.RemoteReward), and what
# the stage does with the run's directory
NOT_FIELDS = frozenset({
    "output_dir", "policy_dir", "reward_dir", "value_init", "value_lora", "activation_checkpointing",
    "reward_timeout_s", "reward_retries", "reward_max_abs",
    "lora.enabled", "lora.r", "lora.alpha", "lora.target_modules",
    "total_episodes", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
    "rollout_forward_batch_size", "resume", "fresh", "merge",
})


@dataclass(frozen=True)
class PPOConfig:
    # optimisation
    learning_rate: float
    value_learning_rate: float | None
    lr_scheduler_type: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float | None
    sparse_value_embedding: bool
    num_ppo_epochs: int
    # sampling
    response_length: int
    temperature: float
    top_k: int
    top_p: float
    stop_token: str | None
    stop_token_ids: tuple[int, ...]
    recompute_logprobs: str             # lower-case text, true / false included
    # rewards and advantages
    reward: tuple[str, ...]
    reward_weights: tuple[float, ...] | None
    advantage: str
    samples_per_prompt: int
    scale_rewards: bool
    loss_aggregation: str
    kl_loss_estimator: str
    # reward shaping and KL
    kl_coef: float
    kl_estimator: str
    adaptive_kl: bool
    adaptive_kl_target: float
    kl_horizon: float
    whiten_rewards: bool
    normalize_scores: bool
    missing_eos_penalty: float | None
    empty_response_penalty: float | None
    first_update_kl_tolerance: float | None
    # losses
    gamma: float
    lam: float
    cliprange: float
    cliprange_value: float
    vf_coef: float
    ent_coef: float
    target_kl: float | None
    # run
    logging_steps: int
    sample_every: int
    save_every: int
    save_total_limit: int | None        # checkpoints kept (rlhf_cli.ppo.checkpoint.prune); None: all
    eval_every: int                     # updates between held-out evaluations (rlhf_cli.ppo.evaluation); 0: none
    keep_best: str | None               # the eval/* metric whose best update's adapter is kept in best/

    @classmethod
    def from_cfg(cls, p) -> PPOConfig:
        """From the `ppo` group (a DictConfig, a mapping or its typed view, rlhf_cli.settings); each value cast by
        its schema entry's kind."""
        return cls(**{f.name: cast(SCHEMA[f"ppo.{f.name}"], p[f.name]) for f in fields(cls)})

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
