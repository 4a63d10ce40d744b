"""The PPO hyper-parameters as one typed object, built once from the `ppo` config group by `from_cfg`.

Each field is a key of the `ppo` group: its type, range, allowed values and meaning are written once, in
`rlhf_cli.keys.SCHEMA["ppo.<field>"]` (checked when the config is composed); `from_cfg` casts by that
entry's kind (`rlhf_cli.settings.cast`: `recompute_logprobs`, true / false / auto, becomes lower-case text). The
dataclass itself is made from those entries (the end of this module), so a new `ppo.*` key is a field once keys.py
has it; tests/test_ppo_config.py checks the fields against the schema. `check` tests the keys that only make sense
together."""

from __future__ import annotations

from dataclasses import fields, make_dataclass

from rlhf_cli.choices import ADVANTAGES, REWARD_MODEL
from rlhf_cli.errors import RlhfError
from rlhf_cli.keys import SCHEMA
from rlhf_cli.settings import annotation, cast

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


class _Hyperparameters:
    """What PPOConfig has beside its fields (`PPOConfig`, below, adds one field per hyper-parameter key)."""

    __slots__ = ()

    @classmethod
    def from_cfg(cls, p):
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


# One frozen field per `ppo.*` key of the schema that is a hyper-parameter (not in NOT_FIELDS, not in a subgroup),
# in the schema's order, typed as the key's kind casts (rlhf_cli.settings.annotation): the fields are not
# written a second time here.
PPOConfig = make_dataclass(
    "PPOConfig",
    [(key[4:], annotation(rule)) for key, rule in SCHEMA.items()
     if key.startswith("ppo.") and "." not in key[4:] and key[4:] not in NOT_FIELDS],
    bases=(_Hyperparameters,), frozen=True)
PPOConfig.__module__ = __name__  # where its annotations are read (typing.get_type_hints)
