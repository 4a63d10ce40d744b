"""Every config key, defined once: its type, range and allowed values (a `Rule`) and what it means (`help`), by
group, in `SCHEMA`. The values themselves are the config groups' in conf/ (which hold values only);
rlhf_cli.schema checks a composed config against this table and `rlhf <command> --help` (rlhf_cli.keyhelp) prints
it. A key added to conf/ is added here, or it is refused as unknown (tests/test_config.py checks both ways).

Imports no torch or transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    STOP_TOKENS,
    STRATEGIES,
    TRAIN_STAGES,
    WANDB_MODES,
)

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


def _saved_modules_key(stage: str) -> dict[str, Rule]:
    """`<stage>.lora.modules_to_save`: whole layers trained beside the adapter (peft's modules_to_save)."""
    return {f"{stage}.lora.modules_to_save": Rule(
        "modules", nullable=True, help="layers trained whole beside the adapter, e.g. [lm_head] or [lm_head, "
        "embed_tokens]: an output layer the adapter alone cannot move (a random or new one); tied input and "
        "output embeddings stay tied; null: none")}


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
    "data.max_eval_rows": whole(1, null=True, help="cap on held-out rows, the first after the split (null: all); "
                                "with data.max_rows, a quick try"),
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
    **_saved_modules_key("sft"),
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
    **_saved_modules_key("dpo"),
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
