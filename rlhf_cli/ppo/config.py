"""The PPO hyper-parameters as one typed object, built once from the `ppo` config group (values are validated
by `rlhf_cli.schema` when the config is composed; here they only get their types)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class PPOConfig:
    # optimisation
    learning_rate: float
    value_learning_rate: float | None   # None: learning_rate
    lr_scheduler_type: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float | None         # None / 0: no clipping
    num_ppo_epochs: int
    # sampling
    response_length: int
    temperature: float
    top_k: int
    top_p: float
    stop_token: str | None              # "eos" or None (fixed-length responses)
    stop_token_ids: tuple[int, ...]
    recompute_logprobs: str             # auto | true | false
    # reward shaping and KL
    kl_coef: float
    kl_estimator: str                   # k1 | k3 | abs | mse
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
                kw[f.name] = tuple(int(i) for i in v)
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
