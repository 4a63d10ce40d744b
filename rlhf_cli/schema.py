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
    QUANTIZATIONS,
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
        "output_dir": text(help="where the stage publishes its output (written whole when it finishes)"),
        "learning_rate": number(gt=0, help="peak learning rate of AdamW"),
        "num_train_epochs": number(gt=0, help="passes over the training rows (max_steps > 0 overrides it)"),
        "max_steps": whole(1, also=(-1,), help="optimizer steps; > 0 overrides num_train_epochs (-1: the epochs "
            "decide)"),
        "per_device_train_batch_size": count(help="rows per micro-batch, per process"),
        "gradient_accumulation_steps": count(help="micro-batches per optimizer step"),
        "per_device_eval_batch_size": count(help="rows per evaluation batch, per process"),
        "max_length": count(help="tokens per row (prompt + answer); longer rows are cut"),
        "lr_scheduler_type": Rule("scheduler", help="learning-rate schedule after warm-up"),
        "warmup_ratio": number(0, lt=1, help="share of the steps spent warming the learning rate up from 0"),
        "weight_decay": number(0, help="AdamW weight decay"),
        "max_grad_norm": number(0, help="gradient norm clipped to this (0: no clipping)"),
        "logging_steps": count(help="optimizer steps between logged metrics"),
        "eval_steps": count(help="optimizer steps between held-out evaluations"),
        "activation_checkpointing": flag(help="recompute decoder layers in the backward instead of keeping their "
            "activations (less memory, about one more forward of time)"),
        # checkpoints and resume (rlhf_cli.stages._common.Checkpoints)
        "save_steps": whole(0, help=f"optimizer steps between checkpoints (0: none); they stay in "
            f".{stage}.partial/ beside output_dir until the run is published, and a killed run continues from the "
            f"latest with {stage}.resume=true"),
        "save_total_limit": whole(1, null=True, help="the newest checkpoints kept (null: all)"),
        "resume": flag(help="continue the interrupted run from its latest checkpoint (the run's settings, data "
            "and models must be the same)"),
        "fresh": flag(help="start over, deleting an interrupted run's checkpoints (without resume or fresh, a "
            "rerun after an interruption is refused)"),
    }.items()}


def _lora_keys(stage: str, enabled: str, target_modules: str = "") -> dict[str, Rule]:
    """The LoRA keys of a stage; `enabled`: what turning it on means there."""
    return {f"{stage}.lora.enabled": flag(help=enabled),
            f"{stage}.lora.r": count(help="LoRA rank"),
            f"{stage}.lora.alpha": count(help="LoRA scaling numerator (the adapter's output is scaled by alpha / r)"),
            f"{stage}.lora.target_modules": Rule("modules", help="layers that get an adapter: all-linear, or a list "
                                                 "such as [q_proj, v_proj]" + target_modules)}


SCHEMA: dict[str, Rule] = {
    # ---- conf/config.yaml (top level)
    "command": one_of(*COMMANDS, help="set by the dispatcher: the rlhf command that runs"),
    "recipe": text(help="set by the recipe file (recipe=NAME picks recipes/NAME.yaml)"),
    "run_dir": text(help="runs/<recipe>, or runs/<recipe>-<file stem> for your own data.train_path; one directory "
        "per stage below it: base/ sft/ reward/ ppo/ dpo/ eval/"),
    "seed": whole(0, 2**32 - 1, help="seeds Python, NumPy and torch for the run (and the tiny base's weights)"),
    "debug": flag(help="true: full tracebacks instead of one-line errors"),
    "dry_run": flag(help="true: print what would run (multi-process launch line) and exit"),
    "export.output_dir": text(null=True, help="`rlhf export`: where the merged PPO policy goes (null: "
        "<ppo.output_dir>/merged)"),
    "logging.report_to": Rule("enum_list", choices=REPORT_TO, help="[tensorboard], [tensorboard, wandb] (Weights "
        "& Biases as well: pip install 'rlhf-cli[wandb]'), or [] for neither"),
    "logging.wandb.project": text(help="Weights & Biases project"),
    "logging.wandb.entity": text(null=True, help="null: your wandb default"),
    "logging.wandb.name": text(null=True, help="null: <recipe>-<command>, plus the job's overrides in a multirun"),
    "logging.wandb.group": text(null=True, help="Weights & Biases group (default: the recipe)"),
    "logging.wandb.mode": one_of(*WANDB_MODES, help="online | offline | disabled; null: WANDB_MODE, else wandb's "
        "default. offline needs no account and keeps the runs for `wandb sync`"),
    "logging.wandb.dir": text(help="runs are written to <dir>/wandb/"),
    # ---- conf/model
    "model.name_or_path": text(help="\"tiny\", a local directory, or a hub id (Qwen/Qwen3-0.6B)"),
    "model.hub": one_of(*MODEL_HUBS, help="where hub ids are resolved: modelscope | hf"),
    "model.revision": text(null=True, help="hub revision: a branch, tag or commit (null: the default branch)"),
    "model.cache_dir": text(null=True, help="hub cache (default: the hub's own)"),
    "model.offline": flag(help="true: use the local hub cache only, never the network"),
    "model.dtype": one_of(*DTYPES, help="storage dtype of frozen weights (reference / base, reward model, frozen "
        "trunks): auto (bf16 on GPUs that support it, else fp16 on CUDA, fp32 on the CPU) | float32 | bfloat16 | "
        "float16. Trainable weights are always fp32; compute precision: device.mixed_precision"),
    "model.quantization": one_of(*QUANTIZATIONS, help="bitsandbytes storage of the frozen decoder weights (QLoRA): "
        "the base under a LoRA adapter (so PPO's reference too), a LoRA value trunk, PPO's and eval's reward "
        "model; 4bit = nf4, 8bit = int8, computed at the run's precision. Needs pip install 'rlhf-cli[qlora]'; "
        "a stage that trains every weight of the policy is refused (rlhf_cli.quantization)"),
    "model.trust_remote_code": flag(help="run the model repository's own Python code (only for repositories you "
        "trust)"),
    "model.attn_implementation": text(null=True, help="null: the library default (sdpa) | eager | "
        "flash_attention_2 (GPU, if installed)"),
    "model.pad_token": text(null=True, help="set when the tokenizer has no pad token distinct from EOS (e.g. "
        "\"<|endoftext|>\")"),
    "model.enable_thinking": flag(help="passed to chat templates that know it (Qwen3): no <think> blocks"),
    "model.adapter_base_check": flag(help="an adapter (ppo, dpo, best/) loads only onto the base content it was "
        "trained on; false: load it onto whatever base is there now (after the SFT was retrained, say)"),
    "model.tiny.dir": text(help="where the tiny base and its tokenizer are built and cached"),
    "model.tiny.seed": whole(0, help="seed of the tiny base's random weights"),
    "model.tiny.vocab_size": whole(260, help="tokenizer size trained on the data (at least 256 byte tokens + 4 "
        "special tokens)"),
    "model.tiny.hidden_size": count(help="tiny base: hidden width"),
    "model.tiny.intermediate_size": count(help="tiny base: MLP width"),
    "model.tiny.num_hidden_layers": count(help="tiny base: decoder layers"),
    "model.tiny.num_attention_heads": count(help="tiny base: attention heads"),
    "model.tiny.num_key_value_heads": count(help="tiny base: key/value heads (grouped-query attention)"),
    "model.tiny.head_dim": count(help="tiny base: width of one attention head"),
    "model.tiny.embedding_rows": whole(1, null=True, help="model vocabulary rows (null: the tokenizer's size); "
        "151936 gives Qwen3's shape"),
    # ---- conf/data
    "data.train_path": text(null=True, help="json / jsonl / parquet file, or a hub dataset name (data=file: "
        "required, your file)"),
    "data.eval_path": text(null=True, empty=True, help="held-out file (null / empty: split eval_ratio off the "
        "train file). The demo's held-out file and checker hold only while train_path is the demo's: a file of your "
        "own is evaluated on eval_ratio split off it, with no checker, unless you set eval_path / ground_truth too"),
    "data.split": text(help="split name for hub datasets"),
    "data.format": one_of("auto", *DATA_FORMATS, help="auto | seed | prompt | conversational | messages"),
    "data.eval_ratio": number(0, lt=1, help="share of the train file held out for evaluation when eval_path is "
        "null (0: none)"),
    "data.split_seed": whole(0, help="seed of the held-out split"),
    "data.system_prompt": text(null=True, empty=True, help="system message put before every prompt (null: none)"),
    "data.chat_template": flag(help="false: prompts are the plain message texts (base models without a chat "
        "template)"),
    "data.sft_on_rejected": flag(help="also train SFT on the rejected answers (the tiny recipe does, so PPO has "
        "work to do)"),
    "data.max_prompt_length": count(help="tokens; longer prompts are dropped (and counted)"),
    "data.max_rows": whole(1, null=True, help="cap on training rows (null: all)"),
    "data.ground_truth": Rule("function", choices=GROUND_TRUTH, nullable=True, help="checker of a response, "
        "logged by `rlhf ppo` and reported by `rlhf eval`: demo_polite, a function module:function or "
        "/path/file.py:function (response text -> bool or a number in [0, 1]; it may also ask for `prompt` and the "
        "row's extra fields by name), or null when the data has none"),
    # ---- conf/device
    "device.name": text(help="the device file's name (set by device=NAME)"),
    "device.accelerator": one_of(*ACCELERATORS, help="cpu | cuda"),
    "device.strategy": one_of(*STRATEGIES, help="single (this process) | ddp | deepspeed "
        "(pip install 'rlhf-cli[deepspeed]'; zero_stage) | fsdp (FSDP2 through accelerate, sharded by decoder layer); "
        "not single: `rlhf <stage>` relaunches itself under accelerate launch"),
    "device.num_processes": whole(1, also=("auto",), help="processes per machine (one per GPU); auto: every "
        "visible GPU"),
    "device.threads": whole(0, help="torch threads per process; 0 = torch's default. More than one thread pays "
        "only for bigger models"),
    "device.fast_paths": one_of(*FAST_PATHS, help="the speed paths of rlhf_cli.accel: auto | on | off. auto: on "
        "the CPU where their checks agree, stock code on GPUs; off: stock code everywhere (for bisecting)"),
    "device.cpu_matmul": one_of(*CPU_MATMUL, help="PPO's fp32 linear layers on the CPU (≥ 32 rows, ≥ 128 wide): "
        "auto | blas | onednn. auto: oneDNN on AMD Zen 5 and later (measured well ahead there: "
        "bench/results/NOTES.md), torch's BLAS on others"),
    "device.mixed_precision": one_of(*MIXED_PRECISIONS, help="compute precision (autocast): auto | no | bf16 | "
        "fp16. auto: bf16 on GPUs that have it, fp16 on other GPUs, no (fp32) on the CPU. Trainable weights and "
        "optimizer state stay fp32"),
    "device.zero_stage": whole(0, 3, help="2: shard optimizer states + gradients; 3: also the parameters"),
    "device.offload_optimizer": flag(help="optimizer states and fp32 master weights in CPU memory (ZeRO-Offload)"),
    "device.offload_params": flag(help="ZeRO-3 / FSDP: parameters in CPU memory between uses"),
    "device.fsdp.version": whole(1, 2, help="FSDP 1 or 2 (FSDP2: per-parameter sharding)"),
    "device.fsdp.reshard_after_forward": flag(help="true: FULL_SHARD (ZeRO-3-like); false: SHARD_GRAD_OP "
        "(ZeRO-2-like)"),
    "device.fsdp.state_dict_type": one_of(*FSDP_STATE_DICT_TYPES, help="how sft / reward gather FSDP weights to "
        "save them"),
    "device.fsdp.activation_checkpointing": flag(help="sft / reward under FSDP: recompute decoder layers in the "
        "backward"),
    "device.fsdp.gather_for_sampling": flag(help="ppo: the policy gathered whole once per rollout (false: layer "
        "by layer per token)"),
    "device.num_machines": count(help="machines in the run; multi-node: run the same command on every "
        "machine, each with its own machine_rank (0: the main one)"),
    "device.machine_rank": whole(0, help="this machine's number, 0 .. num_machines-1"),
    "device.main_process_ip": text(null=True, help="address of machine 0, reachable from all machines (required "
        "when num_machines > 1)"),
    "device.main_process_port": whole(1, 65535, null=True, help="null: a free port on one machine, 29500 across "
        "machines"),
    "device.rdzv_backend": one_of(*RDZV_BACKENDS, help="static | c10d (torchrun rendezvous)"),
    "device.collective_timeout_s": count(help="seconds a process waits in a collective (all-reduce, barrier, "
        "broadcast) for the others before the run fails: a process that died or hangs ends the run with an error "
        "instead of a wait without end"),
    # ---- conf/stage/sft.yaml
    **_trainer_keys("sft"),
    **_lora_keys("sft", "train a LoRA adapter and merge it on save (the output is a plain model); the frozen base "
                        "is stored in model.dtype, the adapter in fp32 (false: full fine-tuning in fp32)"),
    "sft.lora.dropout": number(0, lt=1, help="dropout on the adapter's input"),
    # ---- conf/stage/reward.yaml
    **_trainer_keys("reward"),
    "reward.init_from": text(help="a model directory, or \"base\" for the base model"),
    "reward.center_rewards_coefficient": number(0, null=True, help="weight of a penalty on the mean reward "
        "squared, keeping scores centred near 0 (null: off)"),
    # ---- conf/stage/ppo.yaml
    "ppo.output_dir": text(help="where the PPO adapter (and value model) is published"),
    "ppo.policy_dir": text(help="the SFT output (a plain model directory): the policy's base and the reference"),
    "ppo.reward_dir": text(help="the reward model; needed only when ppo.reward lists `model`"),
    "ppo.value_init": text(help="reward | sft | base | a model directory (gae only; reward without a reward model "
        "in ppo.reward: sft)"),
    "ppo.reward": Rule("sources", choices=(REWARD_MODEL,), help="what scores a response, summed with "
        "reward_weights: model (the reward model at reward_dir, normalised), module:function or "
        "/path/rules.py:function (fn(prompts, responses, **asked) -> one float each, used as returned), "
        "http(s)://host:port/path (a reward server: one JSON POST per batch, {\"rewards\": [...]} back; OpenRLHF's "
        "format too). A function's scores are used as returned (no normalisation: return rewards on the scale "
        "you want next to the KL); missing_eos_penalty and empty_response_penalty apply to the sum; no reward "
        "model is loaded unless `model` is listed. e.g. ppo.reward=[model,rlhf_cli.demo:length_format_reward] "
        "ppo.reward_weights=[1.0,0.5]"),
    "ppo.reward_weights": Rule("number_list", nullable=True, help="one weight per ppo.reward entry, same order "
        "(null: 1 each)"),
    "ppo.reward_timeout_s": number(gt=0, help="a reward server's answer to one batch, in seconds, before the try "
        "fails"),
    "ppo.reward_retries": whole(0, help="tries after a server's first failure, 1 s, 2 s, 4 s... apart; then the "
        "run stops"),
    "ppo.reward_max_abs": number(gt=0, null=True, help="a function's or server's score beyond ±this stops the "
        "run; null: no limit"),
    "ppo.advantage": one_of(*ADVANTAGES, help="the advantage estimator, with the KL to "
        "the reference where its paper puts it. gae: PPO with a value model, per-token KL in the reward; grpo: "
        "group-relative, no critic, samples_per_prompt ≥ 2, KL as a loss term (kl_loss_estimator); rloo: "
        "leave-one-out baseline, no critic, samples_per_prompt ≥ 2, sequence KL in the reward; reinforce_pp: "
        "REINFORCE++, reward-to-go whitened over the batch, no critic, per-token KL in the reward"),
    "ppo.samples_per_prompt": count(help="responses sampled per prompt (≥ 2 for grpo / rloo); must divide the "
        "per-process batch"),
    "ppo.scale_rewards": flag(help="grpo: divide by the group's reward std (false: Dr. GRPO's unscaled advantages)"),
    "ppo.loss_aggregation": one_of(*LOSS_AGGREGATIONS, help="token_mean: every token weighs the same; "
        "sequence_mean: every response does, as the GRPO paper"),
    "ppo.kl_loss_estimator": one_of(*KL_ESTIMATORS, help="grpo: the KL estimate in the loss (k1 | k3 | abs | mse; "
        "k3 as DeepSeekMath)"),
    "ppo.value_lora": flag(help="true: the value model trains a LoRA adapter (+ its score head) on a frozen "
        "trunk stored in model.dtype; false: every weight trains"),
    "ppo.activation_checkpointing": flag(help="true: the policy's and value model's decoder layers keep only "
        "their inputs for the backward and compute the rest again there (less memory per micro-batch, about one "
        "more forward of time)"),
    "ppo.sparse_value_embedding": flag(help="value model trained in full: its input embedding is stepped through "
        "the rows that tokens have reached (the same AdamW result with weight_decay 0, without a dense vocab x "
        "hidden gradient and moments); one process only, else dense"),
    "ppo.total_episodes": count(help="responses sampled over the run (updates = total_episodes / the batch of one "
        "update)"),
    "ppo.per_device_train_batch_size": count(help="micro-batch: responses per forward / backward, per process"),
    "ppo.gradient_accumulation_steps": count(help="micro-batches per optimizer step"),
    "ppo.num_mini_batches": count(help="optimizer steps per PPO epoch"),
    "ppo.rollout_forward_batch_size": count(help="responses per generation / scoring chunk"),
    "ppo.num_ppo_epochs": count(help="passes over one update's responses"),
    "ppo.learning_rate": number(gt=0, help="peak learning rate of the policy adapter"),
    "ppo.value_learning_rate": number(gt=0, null=True, help="null: learning_rate"),
    "ppo.lr_scheduler_type": Rule("scheduler", help="learning-rate schedule over the updates"),
    "ppo.warmup_ratio": number(0, lt=1, help="share of the updates spent warming the learning rate up from 0"),
    "ppo.weight_decay": number(0, help="AdamW weight decay"),
    "ppo.max_grad_norm": number(0, null=True, help="gradient norm clipped to this (null / 0: no clipping)"),
    "ppo.response_length": count(help="tokens sampled per response at most"),
    "ppo.temperature": number(gt=0, help="sampling temperature; log-probs are scored at the same temperature"),
    "ppo.top_k": whole(0, help="sample from the k most likely tokens (0: off)"),
    "ppo.top_p": number(gt=0, hi=1, help="nucleus sampling: the smallest set of tokens holding this probability"),
    "ppo.stop_token": one_of(*STOP_TOKENS, help="eos | null (no stop: fixed length)"),
    "ppo.stop_token_ids": Rule("int_list", lo=0, help="extra ids that also end a response"),
    "ppo.kl_coef": number(0, help="β: the KL penalty's weight (in the reward, or in grpo's loss)"),
    "ppo.kl_estimator": one_of(*KL_ESTIMATORS, help="k1 | k3 | abs | mse: the KL estimate where it is a reward "
        "(gae, rloo, reinforce_pp)"),
    "ppo.adaptive_kl": flag(help="adapt kl_coef towards adaptive_kl_target (Ziegler et al.'s controller)"),
    "ppo.adaptive_kl_target": number(gt=0, help="adaptive controller target (nats per sequence)"),
    "ppo.kl_horizon": number(gt=0, help="the adaptive controller's horizon, in responses"),
    "ppo.gamma": number(0, 1, help="discount per token (gae and reinforce_pp)"),
    "ppo.lam": number(0, 1, help="gae's λ"),
    "ppo.cliprange": number(gt=0, hi=1, help="policy ratio clipped to [1 - this, 1 + this]"),
    "ppo.cliprange_value": number(gt=0, help="value predictions clipped to within this of their old values"),
    "ppo.vf_coef": number(0, help="weight of the value loss"),
    "ppo.ent_coef": number(0, help="weight of an entropy bonus (0: none)"),
    "ppo.target_kl": number(gt=0, null=True, help="stop the epoch loop early when approxkl exceeds this"),
    "ppo.whiten_rewards": flag(help="gae: whiten the per-token rewards (mean kept)"),
    "ppo.normalize_scores": flag(help="(score - mean) / std with the statistics stored by the reward stage"),
    "ppo.missing_eos_penalty": number(null=True, help="subtracted from the score of responses without EOS (null: "
        "none)"),
    "ppo.empty_response_penalty": number(null=True, help="score given to empty responses (null: keep their score)"),
    "ppo.first_update_kl_tolerance": number(gt=0, null=True, help="fail if |log π_old - log π_ref| per token "
        "exceeds this before the first update (LoRA starts at 0); null: 1e-3 in fp32 compute, 2e-2 in bf16/fp16"),
    "ppo.recompute_logprobs": one_of(*RECOMPUTE_LOGPROBS, help="old / reference log-probs from the training "
        "forward (true) or from the sampling pass (false); auto: recompute when compute is not fp32 (the two paths "
        "disagree there)"),
    **_lora_keys("ppo", "the policy trains a LoRA adapter on the SFT model, whose frozen weights are also the "
                        "reference (adapter disabled)"),
    "ppo.logging_steps": count(help="updates between logged metrics"),
    "ppo.sample_every": whole(0, help="updates between sample tables in TensorBoard (0: never)"),
    "ppo.save_every": whole(0, help="updates between checkpoints (0: only at the end); Ctrl-C / a crash resumes "
        "from the latest with ppo.resume=true"),
    "ppo.save_total_limit": whole(1, null=True, help="checkpoints kept: the newest, each written whole before an "
        "older one goes (best/ is apart); null: keep every one"),
    "ppo.eval_every": whole(0, help="updates between evaluations (and one after the last; 0: never): "
        "eval.num_prompts held-out prompts (data.eval_path or the split) sampled with the eval.* settings, measured "
        "as `rlhf eval` does; eval/* metrics in TensorBoard and metrics.json"),
    "ppo.keep_best": text(null=True, help="an eval/* metric: the adapter (and value model) of its best evaluated "
        "update is kept in <output_dir>/best with best.json (eval/ground_truth_rate, eval/rm_score; a leading minus "
        "keeps the lowest: -eval/kl); null: off"),
    "ppo.resume": one_of(True, False, "force", help="true: continue from the latest checkpoint in output_dir, "
        "which must match this config (data, models, batch sizes, LoRA, learning rates...); force: continue with "
        "the changed values"),
    "ppo.fresh": flag(help="start over, deleting an interrupted run's checkpoints (without resume or fresh, a "
        "rerun after an interruption is refused)"),
    "ppo.merge": flag(help="also write a merged full model to <output_dir>/merged"),
    # ---- conf/stage/dpo.yaml
    **_trainer_keys("dpo"),
    **_lora_keys("dpo", "train a LoRA adapter (published as the adapter, on the SFT model as its base); false: "
                        "every weight trains (fp32) against a frozen reference copy in model.dtype",
                 " (trl reads the LM head's weight directly: a LoRA on lm_head would never train)"),
    "dpo.lora.dropout": number(0, lt=1, help="dropout on the adapter's input"),
    "dpo.policy_dir": text(help="the SFT model (a plain model directory)"),
    "dpo.loss_type": one_of(*DPO_LOSSES, help="sigmoid (DPO) | ipo | robust (cDPO, with label_smoothing) | hinge "
        "(SLiC) | exo_pair | nca_pair | bco_pair | sppo_hard | aot | apo_zero | apo_down | discopop | sigmoid_norm"),
    "dpo.beta": number(gt=0, help="β: larger keeps the policy closer to the reference (ipo: its τ)"),
    "dpo.label_smoothing": number(0, lt=0.5, help="robust: the share of preference labels assumed flipped, in [0, "
        "0.5); exo_pair: ε (> 0)"),
    "dpo.rpo_alpha": number(0, null=True, help="RPO: adds rpo_alpha × NLL of the chosen answers to the loss "
        "(null: plain DPO)"),
    # ---- conf/stage/eval.yaml
    "eval.output_dir": text(help="where report.md / report.json and the samples go"),
    "eval.policies": Rule("mapping", help="name: model directory or PPO / DPO output (an adapter); "
        "eval.policies.NAME=DIR adds one, =null leaves one out"),
    "eval.reward_dir": text(null=True, help="null: no reward-model score (a run rewarded by functions alone)"),
    "eval.num_prompts": count(help="held-out prompts evaluated (at most the held-out rows)"),
    "eval.samples_per_prompt": count(help="responses per prompt: pass@1 and pass@k (k = this) with a ground-truth "
        "checker"),
    "eval.batch_size": count(help="prompts per generation batch"),
    "eval.response_length": count(help="tokens per response at most (the cap; responses cut there count as "
        "truncated)"),
    "eval.temperature": number(gt=0, help="sampling temperature"),
    "eval.top_k": whole(0, help="sample from the k most likely tokens (0: off)"),
    "eval.top_p": number(gt=0, hi=1, help="nucleus sampling probability"),
    "eval.greedy": flag(help="true: greedy decoding instead of sampling"),
    # ---- conf/stage/chat.yaml
    "push.dir": text(null=True, help="required: an output of rlhf sft / reward / ppo / dpo / export (e.g. "
        "runs/tiny/ppo)"),
    "push.repo_id": text(null=True, help="required: OWNER/NAME on the hub"),
    "push.hub": one_of(*PUSH_HUBS, help="hf (Hugging Face) | modelscope"),
    "push.private": flag(help="false: a public repository"),
    "push.token": text(null=True, help="null: HF_TOKEN / MODELSCOPE_API_TOKEN, or the Hugging Face login (`hf "
        "auth login`)"),
    "push.dry_run": flag(help="true: list exactly the files that would go up, upload nothing"),
    "push.commit_message": text(help="the commit message on the hub"),
    "chat.model_dir": text(null=True, help="null: the newest trained policy (the PPO output if there is one, else "
        "DPO's, else SFT's); or an SFT directory or a PPO output (its adapter is merged on load)"),
    "chat.prompt": text(null=True, empty=True, help="one prompt, answered once, then exit (null: an interactive "
        "session)"),
    "chat.system_prompt": text(null=True, empty=True, help="system message before the conversation (null: none)"),
    "chat.max_new_tokens": count(help="tokens per answer at most"),
    "chat.temperature": number(gt=0, help="sampling temperature"),
    "chat.top_k": whole(0, help="sample from the k most likely tokens (0: off)"),
    "chat.top_p": number(gt=0, hi=1, help="nucleus sampling probability"),
    "chat.do_sample": flag(help="false: greedy answers"),
    # ---- conf/stage/doctor.yaml
    "doctor.stages": Rule("enum_list", choices=TRAIN_STAGES, help="stages to plan"),
    "doctor.memory_gib": number(gt=0, null=True, help="memory per process to plan against (null: this machine's "
        "GPU, or its free RAM on the CPU)"),
    "doctor.timeout_s": number(gt=0, help="hub reachability check, seconds per host, no retries"),
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
