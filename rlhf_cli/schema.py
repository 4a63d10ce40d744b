"""The config schema: one table (`SCHEMA`) of every key under the project's config groups with its type and
allowed values, checked once after composition by `validate(cfg)`, before any stage starts or any model is
built. A bad value fails as one line naming the key, the value and what is allowed
(`ppo.total_episodes=abc is not an integer; use a whole number ≥ 1`), instead of deep inside a library
(`invalid literal for int()`, `ZeroDivisionError`, `Invalid learning rate: nan`).

Keys under the groups that the table does not know are refused too, with the closest known key:
`+sft.max_step=2` would otherwise be composed and silently ignored. `check_override_keys` does the same for
the command line before Hydra runs, so `sft.max_step=2` and `+sft.max_step=2` get the same answer. Top-level
keys other than the project's own, `hydra.*`, and free-form values (`eval.policies`, a dict of name ->
directory) are left alone.

Imports no torch or transformers (config errors answer in well under a second).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf_cli.choices import (
    ACCELERATORS,
    ADVANTAGES,
    COMMANDS,
    CPU_MATMUL,
    DATA_FORMATS,
    DPO_LOSSES,
    DTYPES,
    FAST_PATHS,
    FSDP_STATE_DICT_TYPES,
    GROUND_TRUTH,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    MIXED_PRECISIONS,
    MODEL_HUBS,
    PUSH_HUBS,
    RDZV_BACKENDS,
    RECOMPUTE_LOGPROBS,
    REPORT_TO,
    REWARD_MODEL,
    SCHEDULERS,
    SCHEDULERS_NOT_RUN,
    STOP_TOKENS,
    STRATEGIES,
    TRAIN_STAGES,
    WANDB_MODES,
)
from rlhf_cli.errors import RlhfError
from rlhf_cli.stage_table import NEEDS_DATA  # commands that read data.train_path

# config groups whose keys are all known: anything else under them is a typo or a key that has gone
GROUPS = ("model", "data", "device", *COMMANDS, "logging")  # config groups: one per command
# keys that existed once: their own message instead of a guess
RENAMED = {"ppo.target_kl_value": "ppo.adaptive_kl_target"}
REMOVED = {"ppo.lora.dropout": "the PPO adapter trains without dropout (its old log-probs come from sampling "
                               "in eval mode); sft.lora.dropout is the SFT one"}


@dataclass(frozen=True)
class Rule:
    """What one key accepts. `kind`: int | float | bool | text | enum | scheduler | int_list | enum_list |
    modules (a module name or a list of them) | mapping (name -> text) | function (one of `choices` or a
    `module:function` / `path.py:function` reference) | sources (a list of `choices` and function references) |
    number_list (finite numbers). `help`: what the key means, where its allowed values do not say it."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False      # lo itself is refused (> lo rather than ≥ lo)
    hi_open: bool = False
    choices: tuple = ()        # enum / enum_list: the values; int: values allowed besides the range
    nullable: bool = False     # null is allowed (the yaml's default is null, or null means "automatic")
    empty: bool = False        # text: the empty string is allowed
    help: str = field(default="", compare=False)


def whole(lo: int | None = None, hi: int | None = None, *, also: tuple = (), null: bool = False,
          help: str = "") -> Rule:
    return Rule("int", lo=lo, hi=hi, choices=also, nullable=null, help=help)


def number(lo: float | None = None, hi: float | None = None, *, gt: float | None = None,
           lt: float | None = None, null: bool = False, help: str = "") -> Rule:
    """A finite number in [lo, hi]; `gt` / `lt` instead of `lo` / `hi` leave the bound itself out."""
    return Rule("float", lo=gt if gt is not None else lo, hi=lt if lt is not None else hi,
                lo_open=gt is not None, hi_open=lt is not None, nullable=null, help=help)


def flag(help: str = "") -> Rule:
    return Rule("bool", help=help)


def text(*, null: bool = False, empty: bool = False, help: str = "") -> Rule:
    """A string: a path, a name, a prompt. Non-empty unless `empty`."""
    return Rule("text", nullable=null, empty=empty, help=help)


def one_of(*choices, help: str = "") -> Rule:
    """One of the listed values; a None among them means null is allowed."""
    return Rule("enum", choices=tuple(c for c in choices if c is not None), nullable=None in choices, help=help)


def count(help: str = "") -> Rule:
    """A size or a number of steps: 0 makes no sense."""
    return whole(1, help=help)


PROB = number(0, 1)
LR = number(gt=0)


def _trainer_keys(stage: str) -> dict[str, Rule]:
    """The keys sft, reward and dpo share: TrainingArguments fields (rlhf_cli.stages._common.trainer_kwargs)."""
    return {f"{stage}.{k}": r for k, r in {
        "output_dir": text(),
        "learning_rate": LR,
        "num_train_epochs": number(gt=0),
        "max_steps": whole(1, also=(-1,), help="-1: num_train_epochs decides"),
        "per_device_train_batch_size": count(),
        "gradient_accumulation_steps": count(),
        "per_device_eval_batch_size": count(),
        "max_length": count(),
        "lr_scheduler_type": Rule("scheduler"),
        "warmup_ratio": number(0, lt=1),
        "weight_decay": number(0),
        "max_grad_norm": number(0, help="0: no clipping"),
        "logging_steps": count(),
        "eval_steps": count(),
        "activation_checkpointing": flag(),
        # checkpoints and resume (rlhf_cli.stages._common.Checkpoints)
        "save_steps": whole(0, help="0: no checkpoints"),
        "save_total_limit": whole(1, null=True, help="null: keep all"),
        "resume": flag(help="continue the interrupted run from its latest checkpoint"),
        "fresh": flag(help="delete an interrupted run (its checkpoints) and start over"),
    }.items()}


def _lora_keys(stage: str) -> dict[str, Rule]:
    return {f"{stage}.lora.enabled": flag(), f"{stage}.lora.r": count(), f"{stage}.lora.alpha": count(),
            f"{stage}.lora.target_modules": Rule("modules")}


SCHEMA: dict[str, Rule] = {
    # ---- conf/config.yaml (top level)
    "command": one_of(*COMMANDS),
    "recipe": text(),
    "run_dir": text(),
    "seed": whole(0, 2**32 - 1),
    "debug": flag(),
    "dry_run": flag(),
    "export.output_dir": text(null=True),
    "logging.report_to": Rule("enum_list", choices=REPORT_TO, help="rlhf_cli.tracking's backends"),
    "logging.wandb.project": text(),
    "logging.wandb.entity": text(null=True),
    "logging.wandb.name": text(null=True),
    "logging.wandb.group": text(null=True),
    "logging.wandb.mode": one_of(*WANDB_MODES),
    "logging.wandb.dir": text(),
    # ---- conf/model
    "model.name_or_path": text(),
    "model.hub": one_of(*MODEL_HUBS),
    "model.revision": text(null=True),
    "model.cache_dir": text(null=True),
    "model.offline": flag(),
    "model.dtype": one_of(*DTYPES, help="storage of frozen weights (rlhf_cli.precision)"),
    "model.trust_remote_code": flag(),
    "model.attn_implementation": text(null=True, help="a kernel the library refuses fails at load, named"),
    "model.pad_token": text(null=True),
    "model.enable_thinking": flag(),
    "model.adapter_base_check": flag(help="false: load an adapter onto a base whose content changed since it was "
                                          "trained (rlhf_cli.identity)"),
    "model.tiny.dir": text(),
    "model.tiny.seed": whole(0),
    "model.tiny.vocab_size": whole(260, help="256 byte tokens + the 4 special tokens (rlhf_cli.tiny)"),
    "model.tiny.hidden_size": count(),
    "model.tiny.intermediate_size": count(),
    "model.tiny.num_hidden_layers": count(),
    "model.tiny.num_attention_heads": count(),
    "model.tiny.num_key_value_heads": count(),
    "model.tiny.head_dim": count(),
    "model.tiny.embedding_rows": whole(1, null=True, help="null: the tokenizer's size; fewer: refused by tiny"),
    # ---- conf/data
    "data.train_path": text(null=True, help="null: data=file without a file; the data loader says so"),
    "data.eval_path": text(null=True, empty=True, help="null / empty: split eval_ratio off the train file"),
    "data.split": text(),
    "data.format": one_of("auto", *DATA_FORMATS),
    "data.eval_ratio": number(0, lt=1),
    "data.split_seed": whole(0),
    "data.system_prompt": text(null=True, empty=True),
    "data.chat_template": flag(),
    "data.sft_on_rejected": flag(),
    "data.max_prompt_length": count(),
    "data.max_rows": whole(1, null=True),
    "data.ground_truth": Rule("function", choices=GROUND_TRUTH, nullable=True, help="rlhf_cli.ppo.rewards"),
    # ---- conf/device
    "device.name": text(),
    "device.accelerator": one_of(*ACCELERATORS),
    "device.strategy": one_of(*STRATEGIES),
    "device.num_processes": whole(1, also=("auto",)),
    "device.threads": whole(0, help="0: torch's default"),
    "device.fast_paths": one_of(*FAST_PATHS, help="the speed paths of rlhf_cli.accel: auto = on the CPU where "
                                "their checks agree, stock code on GPUs; on; off = stock code everywhere"),
    "device.cpu_matmul": one_of(*CPU_MATMUL, help="rlhf_cli.accel.cpu_linear"),
    "device.mixed_precision": one_of(*MIXED_PRECISIONS, help="the compute dtype (rlhf_cli.precision)"),
    "device.zero_stage": whole(0, 3),
    "device.offload_optimizer": flag(),
    "device.offload_params": flag(),
    "device.fsdp.version": whole(1, 2),
    "device.fsdp.reshard_after_forward": flag(),
    "device.fsdp.state_dict_type": one_of(*FSDP_STATE_DICT_TYPES),
    "device.fsdp.activation_checkpointing": flag(),
    "device.fsdp.gather_for_sampling": flag(),
    "device.num_machines": count(),
    "device.machine_rank": whole(0, help="< num_machines: checked by rlhf_cli.launch"),
    "device.main_process_ip": text(null=True),
    "device.main_process_port": whole(1, 65535, null=True),
    "device.rdzv_backend": one_of(*RDZV_BACKENDS),
    "device.collective_timeout_s": count(help="seconds a collective may wait before the run fails"),
    # ---- conf/stage/sft.yaml
    **_trainer_keys("sft"),
    **_lora_keys("sft"),
    "sft.lora.dropout": number(0, lt=1),
    # ---- conf/stage/reward.yaml
    **_trainer_keys("reward"),
    "reward.init_from": text(help='a model directory, or "base"'),
    "reward.center_rewards_coefficient": number(0, null=True),
    # ---- conf/stage/ppo.yaml
    "ppo.output_dir": text(),
    "ppo.policy_dir": text(),
    "ppo.reward_dir": text(),
    "ppo.value_init": text(help="reward | sft | base | a model directory"),
    "ppo.reward": Rule("sources", choices=(REWARD_MODEL,), help="summed; functions, servers: rlhf_cli.ppo.rewards"),
    "ppo.reward_weights": Rule("number_list", nullable=True, help="one per source (PPOConfig.check); null: 1 each"),
    "ppo.reward_timeout_s": number(gt=0, help="seconds a reward server may take to answer one batch"),
    "ppo.reward_retries": whole(0, help="tries after a reward server's first failed one, with exponential backoff"),
    "ppo.reward_max_abs": number(gt=0, null=True, help="the largest |score| a reward function or server may give "
                                 "(rlhf_cli.ppo.rewards); null: no limit"),
    "ppo.advantage": one_of(*ADVANTAGES),
    "ppo.samples_per_prompt": count(help="responses per prompt; ≥ 2 for grpo / rloo, divides the batch "
                                    "(PPOConfig.check)"),
    "ppo.scale_rewards": flag(help="grpo: divide by the group's std (false: Dr. GRPO)"),
    "ppo.loss_aggregation": one_of(*LOSS_AGGREGATIONS),
    "ppo.kl_loss_estimator": one_of(*KL_ESTIMATORS, help="grpo: the KL estimate in its loss"),
    "ppo.value_lora": flag(),
    "ppo.activation_checkpointing": flag(help="the policy's and value model's decoder layers recomputed in the "
                                         "backward instead of keeping their activations"),
    "ppo.sparse_value_embedding": flag(help="a fully trained value model's embedding: AdamW over the rows "
                                       "tokens reach"),
    "ppo.total_episodes": count(help="≥ one update's batch: checked by config.ppo_sizes"),
    "ppo.per_device_train_batch_size": count(),
    "ppo.gradient_accumulation_steps": count(),
    "ppo.num_mini_batches": count(),
    "ppo.rollout_forward_batch_size": count(),
    "ppo.num_ppo_epochs": count(),
    "ppo.learning_rate": LR,
    "ppo.value_learning_rate": number(gt=0, null=True, help="null: learning_rate"),
    "ppo.lr_scheduler_type": Rule("scheduler"),
    "ppo.warmup_ratio": number(0, lt=1),
    "ppo.weight_decay": number(0),
    "ppo.max_grad_norm": number(0, null=True, help="null / 0: no clipping"),
    "ppo.response_length": count(),
    "ppo.temperature": number(gt=0),
    "ppo.top_k": whole(0, help="0: off"),
    "ppo.top_p": number(gt=0, hi=1),
    "ppo.stop_token": one_of(*STOP_TOKENS, help="null: fixed-length responses"),
    "ppo.stop_token_ids": Rule("int_list", lo=0),
    "ppo.kl_coef": number(0),
    "ppo.kl_estimator": one_of(*KL_ESTIMATORS, help="where the KL is a reward: gae, rloo, reinforce_pp"),
    "ppo.adaptive_kl": flag(),
    "ppo.adaptive_kl_target": number(gt=0, help="nats per sequence, for the adaptive controller"),
    "ppo.kl_horizon": number(gt=0),
    "ppo.gamma": PROB,
    "ppo.lam": PROB,
    "ppo.cliprange": number(gt=0, hi=1),
    "ppo.cliprange_value": number(gt=0),
    "ppo.vf_coef": number(0),
    "ppo.ent_coef": number(0),
    "ppo.target_kl": number(gt=0, null=True, help="stop an update's epochs early when approxkl exceeds this"),
    "ppo.whiten_rewards": flag(),
    "ppo.normalize_scores": flag(),
    "ppo.missing_eos_penalty": number(null=True),
    "ppo.empty_response_penalty": number(null=True),
    "ppo.first_update_kl_tolerance": number(gt=0, null=True, help="null: by compute precision"),
    "ppo.recompute_logprobs": one_of(*RECOMPUTE_LOGPROBS),
    **_lora_keys("ppo"),
    "ppo.logging_steps": count(),
    "ppo.sample_every": whole(0, help="0: never"),
    "ppo.save_every": whole(0, help="0: only at the end"),
    "ppo.save_total_limit": whole(1, null=True, help="checkpoints kept, the newest (each complete); null: keep all"),
    "ppo.eval_every": whole(0, help="updates between evaluations on held-out prompts (eval/* metrics), and after "
                            "the last; 0: never"),
    "ppo.keep_best": text(null=True, help="an eval/* metric (eval/ground_truth_rate, eval/rm_score; -eval/kl: "
                          "lowest): its best update's adapter and value model are kept in <output_dir>/best"),
    "ppo.resume": one_of(True, False, "force", help="force: continue although the run config that shapes the "
                         "run changed (rlhf_cli.ppo.checkpoint.compare_run_config)"),
    "ppo.fresh": flag(help="delete an interrupted run (its checkpoints) and start over"),
    "ppo.merge": flag(),
    # ---- conf/stage/dpo.yaml
    **_trainer_keys("dpo"),
    **_lora_keys("dpo"),
    "dpo.lora.dropout": number(0, lt=1),
    "dpo.policy_dir": text(help="the SFT model DPO starts from; with LoRA also the reference"),
    "dpo.loss_type": one_of(*DPO_LOSSES, help="trl DPOConfig.loss_type"),
    "dpo.beta": number(gt=0, help="β: how far the policy may move from the reference (ipo: τ)"),
    "dpo.label_smoothing": number(0, lt=0.5, help="robust: the share of flipped labels; exo_pair: ε (> 0)"),
    "dpo.rpo_alpha": number(0, null=True, help="RPO: weight of the NLL of the chosen answers added to the loss; "
                            "null / 0: none"),
    # ---- conf/stage/eval.yaml
    "eval.output_dir": text(),
    "eval.policies": Rule("mapping"),
    "eval.reward_dir": text(null=True, help="null: no reward-model scores (a run rewarded by functions alone)"),
    "eval.num_prompts": count(),
    "eval.samples_per_prompt": count(help="responses sampled per held-out prompt: pass@1 and pass@k (k = this) "
                                     "where data.ground_truth checks them; also ppo.eval_every's eval/*"),
    "eval.batch_size": count(),
    "eval.response_length": count(),
    "eval.temperature": number(gt=0),
    "eval.top_k": whole(0),
    "eval.top_p": number(gt=0, hi=1),
    "eval.greedy": flag(),
    # ---- conf/stage/chat.yaml
    "push.dir": text(null=True, help="an output directory of rlhf sft / reward / ppo / dpo / export"),
    "push.repo_id": text(null=True, help="OWNER/NAME on the hub"),
    "push.hub": one_of(*PUSH_HUBS),
    "push.private": flag(),
    "push.token": text(null=True),
    "push.dry_run": flag(help="list the files that would go up, upload nothing"),
    "push.commit_message": text(),
    "chat.model_dir": text(null=True),
    "chat.prompt": text(null=True, empty=True),
    "chat.system_prompt": text(null=True, empty=True),
    "chat.max_new_tokens": count(),
    "chat.temperature": number(gt=0),
    "chat.top_k": whole(0),
    "chat.top_p": number(gt=0, hi=1),
    "chat.do_sample": flag(),
    # ---- conf/stage/doctor.yaml
    "doctor.stages": Rule("enum_list", choices=TRAIN_STAGES, help="stages rlhf_cli.memory plans"),
    "doctor.memory_gib": number(gt=0, null=True, help="null: this machine's GPU or free RAM"),
    "doctor.timeout_s": number(gt=0),
}

# dict nodes above the keys (ppo.lora, device.fsdp, model.tiny): walked into, not checked as values
_PARENTS = {key.rsplit(".", i)[0] for key in SCHEMA for i in range(1, key.count(".") + 1)}


# ------------------------------------------------------------------------------------------------- checks
def validate(cfg: DictConfig) -> None:
    """Check every key of the composed config against `SCHEMA`; raise one RlhfError naming the first bad key
    (and listing the others). Keys missing from the config are skipped: an older or newer conf/ still runs."""
    problems = list(_problems(cfg))
    if problems:
        first, *rest = problems
        more = f" (also check {', '.join(key for key, _ in rest)})" if rest else ""
        raise RlhfError(first[1] + more)




def check_inputs(cfg: DictConfig) -> None:
    """Inputs a command cannot run without, checked before any model is fetched (a hub download can take long)."""
    if cfg.get("command") in NEEDS_DATA and not cfg.data.get("train_path"):
        raise RlhfError(f"data.train_path is not set: recipe {cfg.get('recipe')} trains on your preference file; "
                        f"e.g. rlhf {cfg.command} recipe={cfg.get('recipe')} data.train_path=pairs.jsonl")


def check_override_keys(overrides: list[str], command: str = "") -> None:
    """Refuse command-line overrides of keys that the groups do not have (`sft.max_step=2`, `+sft.max_step=2`)
    before Hydra composes anything, and top-level names that are neither a key nor a group (`+foo=bar`). Group
    choices (`device=cuda`), top-level keys and `hydra.*` keys pass."""
    # `recipes=` is the recipe group itself, as `rlhf_cli.launch` passes a recipe to the processes it starts
    tops = {k.split(".", 1)[0] for k in SCHEMA} | set(GROUPS) | {"hydra", "recipes"}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("~+").strip()
        head = key.split(".", 1)[0].split("@", 1)[0]
        if head not in tops:  # a top-level typo (`+foo=bar`, `sed=1`) is refused like a group key's
            close = difflib.get_close_matches(head, sorted(tops - {"hydra", "command"}), n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]}?" if close
                    else f"`rlhf {command or '<command>'} --cfg job` prints the keys")
            raise RlhfError(f"{key} is not a config key; {hint}")
        if "." not in key or "@" in key or head not in GROUPS:
            continue
        if key in SCHEMA or key in _PARENTS or any(key.startswith(k + ".") for k in SCHEMA):
            continue
        raise RlhfError(unknown_key_message(key, command))


def unknown_key_message(key: str, command: str = "") -> str:
    """`sft.max_step is not a config key; did you mean sft.max_steps?`"""
    if key in RENAMED:
        return f"{key} is now {RENAMED[key]}; rename it in your command line or recipe"
    if key in REMOVED:
        return f"{key} is not a config key any more: {REMOVED[key]}"
    group, rest = key.split(".", 1)
    known = sorted(k for k in (*SCHEMA, *_PARENTS) if k.split(".", 1)[0] == group)
    # matched below the group name, which every candidate shares (it would make `ppo.lr` look like `ppo.lam`)
    leaves = [k.split(".", 1)[1] for k in known if k in SCHEMA]
    close = difflib.get_close_matches(rest, leaves, n=1, cutoff=0.75)
    if close:
        return f"{key} is not a config key; did you mean {group}.{close[0]}?"
    parent = key.rsplit(".", 1)[0]
    siblings = [k.rsplit(".", 1)[1] for k in known if "." in k and k.rsplit(".", 1)[0] == parent]
    if 0 < len(siblings) <= 10:
        return f"{key} is not a config key; {parent} has {', '.join(siblings)}"
    where = f"`rlhf {command} --cfg job`" if command else "`rlhf <command> --cfg job`"
    return f"{key} is not a config key; {where} prints the keys"


def _problems(cfg: DictConfig):
    """(key, message) for every bad value and unknown key, in config order."""
    try:
        command = str(cfg.get("command") or "")
    except OmegaConfBaseException:
        command = ""
    for key in map(str, cfg.keys()):
        if key not in GROUPS and key not in SCHEMA:
            continue  # hydra.*, and top-level keys of the user's own
        value = _read(cfg, key)
        if isinstance(value, tuple):
            yield value
        elif key in SCHEMA:
            yield from _checked(key, value)
        elif isinstance(value, DictConfig):
            yield from _walk(value, key, command)
        else:
            yield key, f"{key}={_show(value)} is not a config group; set its keys instead ({key}.KEY=VALUE)"


def _walk(node: DictConfig, prefix: str, command: str):
    for name in map(str, node.keys()):
        path = f"{prefix}.{name}"
        value = _read(node, name, path)
        if isinstance(value, tuple):
            yield value
        elif path in SCHEMA:
            yield from _checked(path, value)
        elif path in _PARENTS and isinstance(value, DictConfig):
            yield from _walk(value, path, command)
        elif path in _PARENTS:
            yield path, f"{path}={_show(value)} is not a group of keys; set its keys ({path}.KEY=VALUE)"
        else:
            yield path, unknown_key_message(path, command)


def _read(node: DictConfig, name: str, path: str | None = None):
    """The resolved value, or (path, message) when an interpolation or a ??? cannot be resolved."""
    path = path or name
    try:
        value = node[name]
        if isinstance(value, (DictConfig, ListConfig)) and not (path in _PARENTS or path in GROUPS):
            value = OmegaConf.to_container(value, resolve=True)
        return value
    except OmegaConfBaseException as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return path, f"{path} cannot be resolved ({reason}); set it: {path}=VALUE"


def _checked(key: str, value):
    message = check_value(key, value, SCHEMA[key])
    if message:
        yield key, message


def check_value(key: str, value, rule: Rule) -> str | None:
    """None if `value` is allowed for `key`, else one line: key=value, what is wrong, what to use."""
    shown = f"{key}={_show(value)}"
    allowed = describe(rule)
    if value is None:
        return None if rule.nullable else f"{shown} is not allowed; use {allowed}"
    if rule.kind == "int" and any(_same(value, c) for c in rule.choices):
        return None
    if rule.kind == "int":
        if not _is_int(value):
            return f"{shown} is not an integer; use {allowed}"
        return None if _in_range(value, rule) else f"{shown} is out of range; use {allowed}"
    if rule.kind == "float":
        if not _is_number(value):
            return f"{shown} is not a number; use {allowed}"
        if not math.isfinite(value):
            return f"{shown} is not a finite number; use {allowed}"
        return None if _in_range(value, rule) else f"{shown} is out of range; use {allowed}"
    if rule.kind == "bool":
        return None if isinstance(value, bool) else f"{shown} is not true or false; use {allowed}"
    if rule.kind == "text":
        if not isinstance(value, str):
            return f"{shown} is not text; quote it ({key}='{_show(value)}')"
        return None if value or rule.empty else f"{key} is empty; use {allowed}"
    if rule.kind == "enum":
        return None if any(_same(value, c) for c in rule.choices) else f"{shown} is unknown; use {allowed}"
    if rule.kind == "scheduler":
        return _check_scheduler(key, value)
    if rule.kind == "int_list":
        if not isinstance(value, list) or not all(_is_int(v) and _in_range(v, rule) for v in value):
            return f"{shown} is not a list of token ids; use {allowed}"
        return None
    if rule.kind == "enum_list":
        if not isinstance(value, list):
            return f"{shown} is not a list; use {allowed}"
        bad = [v for v in value if not any(_same(v, c) for c in rule.choices)]
        return f"{key}: {', '.join(map(_show, bad))} is unknown; use {allowed}" if bad else None
    if rule.kind == "modules":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            return f"{shown} is not a module name or a list of them; use {allowed}"
        return None
    if rule.kind == "function":
        if isinstance(value, str) and (value in rule.choices or _function_ref(value)):
            return None
        return f"{shown} is unknown; use {allowed}"
    if rule.kind == "sources":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names:
            return f"{shown} is not a list of reward sources; use {allowed}"
        url_errors = [server_url_error(key, v) for v in names if isinstance(v, str) and is_server_url(v)]
        if any(url_errors):
            return next(e for e in url_errors if e)
        bad = [v for v in names if not (isinstance(v, str) and (v in rule.choices or is_server_url(v)
                                                                or _function_ref(v)))]
        return f"{key}: {_show(bad[0])} is not a reward source; use {allowed}" if bad else None
    if rule.kind == "number_list":
        if not isinstance(value, list) or not value or not all(_is_number(v) and math.isfinite(v) for v in value):
            return f"{shown} is not a list of numbers; use {allowed}"
        return None
    if rule.kind == "mapping":
        if not isinstance(value, dict) or not value:
            return f"{shown} is not a mapping of names to directories; use {allowed}"
        bad = [k for k, v in value.items() if v is not None and (not isinstance(v, str) or not v)]
        if bad:
            return f"{key}.{bad[0]}={_show(value[bad[0]])} is not a directory; use {allowed}"
        return None if any(v is not None for v in value.values()) else f"{shown} leaves nothing; use {allowed}"
    raise AssertionError(f"schema: unknown rule kind {rule.kind!r} for {key}")


def describe(rule: Rule) -> str:
    """What a rule accepts, in words: `a whole number ≥ 1`, `a number in [0, 1)`, `one of k1, k3, mse`."""
    if rule.kind == "int":
        also = [_show(c) for c in rule.choices]
        base = f"a whole number {_range(rule)}".rstrip()
        text_ = " or ".join([*also, base]) if also else base
    elif rule.kind == "float":
        text_ = f"a number {_range(rule)}".rstrip()
    elif rule.kind == "bool":
        text_ = "true or false"
    elif rule.kind == "text":
        text_ = "a non-empty text" if not rule.empty else "a text"
    elif rule.kind == "enum":
        names = [_show(c) for c in rule.choices] + (["null"] if rule.nullable else [])
        return " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)
    elif rule.kind == "scheduler":
        text_ = "one of " + ", ".join(SCHEDULERS)
    elif rule.kind == "int_list":
        text_ = "a list of token ids, e.g. [151643, 151645], or []"
    elif rule.kind == "enum_list":
        text_ = "a list of " + ", ".join(_show(c) for c in rule.choices)
    elif rule.kind == "modules":
        text_ = "a module name (all-linear) or a list such as [q_proj, v_proj]"
    elif rule.kind == "mapping":
        text_ = "NAME: DIRECTORY entries (eval.policies.NAME=DIR; eval.policies.NAME=null leaves one out)"
    elif rule.kind == "function":
        names = [_show(c) for c in rule.choices] + (["null"] if rule.nullable else [])
        return f"{' or '.join(names)}, or a function as module:function or /path/file.py:function"
    elif rule.kind == "sources":
        text_ = (f"a list of {', '.join(rule.choices)}, functions (module:function or /path/file.py:function) and "
                 f"reward server URLs (http(s)://host:port/path), e.g. [model] or [rlhf_cli.demo:polite_reward]")
    elif rule.kind == "number_list":
        text_ = "a list of numbers, e.g. [1.0, 0.5]"
    else:
        text_ = rule.kind
    return text_ + (", or null" if rule.nullable else "")


def _check_scheduler(key: str, value) -> str | None:
    if isinstance(value, str) and value in SCHEDULERS:
        return None
    allowed = ", ".join(SCHEDULERS)
    if isinstance(value, str) and value in SCHEDULERS_NOT_RUN:
        return (f"{key}={value} needs a metric or scheduler arguments that rlhf does not pass; use one of "
                f"{allowed}")
    return f"{key}={_show(value)} is unknown; use one of {allowed}"


def scheduler_types() -> tuple[str, ...]:
    """transformers' SchedulerType names. Importing transformers takes seconds (it imports torch), so the
    lists above are written out and checked against this by the tests, not at run time."""
    from transformers.trainer_utils import SchedulerType

    return tuple(s.value for s in SchedulerType)


# ------------------------------------------------------------------------------------------------- helpers
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _function_ref(v: str) -> bool:
    """`module:function` or `path.py:function` in shape (whether it imports is checked when the stage starts)."""
    target, sep, name = v.rpartition(":")
    ident = r"[A-Za-z_][A-Za-z0-9_]*"
    if not sep or not target or not re.fullmatch(rf"{ident}(\.{ident})*", name):
        return False
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    return is_file or bool(re.fullmatch(rf"{ident}(\.{ident})*", target))


def is_server_url(v: str) -> bool:
    """A `ppo.reward` entry that names a reward server rather than a function (rlhf_cli.ppo.rewards.RemoteReward)."""
    return v[:8].lower().startswith(("http://", "https://"))


def server_url_error(key: str, v: str) -> str | None:
    """None if `v` is a usable http(s) URL (a host, a port in range if given, no spaces), else one line saying
    what is wrong with it."""
    if any(ch.isspace() for ch in v):
        problem = "it contains a space"
    else:
        try:
            parts = urlsplit(v)
            port = parts.port
        except ValueError as e:  # a port that is not a number or out of range
            problem = str(e)
        else:
            problem = "no host" if not parts.hostname else "port 0" if port == 0 else None
    return f"{key}: {v} is not a reward server URL ({problem}); use http(s)://host[:port]/path" if problem else None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(a, b) -> bool:
    """Equal and of the same type: True is not 1, and "1" is not 1."""
    return type(a) is type(b) and a == b


def _in_range(v, rule: Rule) -> bool:
    if rule.lo is not None and (v < rule.lo or (rule.lo_open and v == rule.lo)):
        return False
    return not (rule.hi is not None and (v > rule.hi or (rule.hi_open and v == rule.hi)))


def _range(rule: Rule) -> str:
    lo, hi = rule.lo, rule.hi
    if lo is not None and hi is not None:
        return f"in {'(' if rule.lo_open else '['}{_show(lo)}, {_show(hi)}{')' if rule.hi_open else ']'}"
    if lo is not None:
        return f"{'>' if rule.lo_open else '≥'} {_show(lo)}"
    if hi is not None:
        return f"{'<' if rule.hi_open else '≤'} {_show(hi)}"
    return ""


def _show(v) -> str:
    """A value as the user would type it on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_show(x)}" for k, x in v.items()) + "}"
    if isinstance(v, str) and not v:
        return "''"
    return str(v)
