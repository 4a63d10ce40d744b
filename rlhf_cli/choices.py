"""Every closed list of config values, defined once: the schema checks against these, and the code that acts
on a value imports its list from here. Imports nothing but the stage table (the doctor and `--help` stay
torch-free)."""

# ---- commands and stages: read from the stage table (rlhf_cli.stage_table)
from rlhf_cli.stage_table import COMMANDS, TRAIN_STAGES  # noqa: F401 - `command`; doctor.stages

# ---- model and data
MODEL_HUBS = ("modelscope", "hf")                            # model.hub
DTYPES = ("auto", "float32", "bfloat16", "float16")          # model.dtype: storage of frozen weights
QUANTIZATIONS = ("none", "4bit", "8bit")   # model.quantization: bitsandbytes storage of frozen linear layers
DATA_FORMATS = ("seed", "prompt", "conversational", "messages")   # data.format, besides auto (rlhf_cli.data)
GROUND_TRUTH_SPECS = {"demo_polite": "rlhf_cli.demo:is_polite"}  # data.ground_truth's built-in names
GROUND_TRUTH = tuple(GROUND_TRUTH_SPECS)
PUSH_HUBS = ("hf", "modelscope")                             # push.hub (rlhf_cli.stages.push)

# ---- device
ACCELERATORS = ("cpu", "cuda")                               # device.accelerator
STRATEGIES = ("single", "ddp", "deepspeed", "fsdp")          # device.strategy (rlhf_cli.launch)
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")            # device.mixed_precision: the compute dtype
FAST_PATHS = ("auto", "on", "off")   # device.fast_paths: the speed paths of rlhf_cli.accel
CPU_MATMUL = ("auto", "blas", "onednn")                      # device.cpu_matmul (rlhf_cli.accel.cpu_linear)
FSDP_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
RDZV_BACKENDS = ("static", "c10d")

# ---- training
# learning-rate schedules, by transformers' SchedulerType names (tests/test_config.py checks both lists)
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt")  # need nothing but the warmup and total step counts
# need a metric (reduce_lr_on_plateau, greedy) or arguments rlhf does not pass (min_lr, num_decay_steps), and
# fail inside the trainer or the PPO loop
SCHEDULERS_NOT_RUN = ("reduce_lr_on_plateau", "greedy", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                      "warmup_stable_decay")

# ---- ppo
REWARD_MODEL = "model"                # the ppo.reward entry that means the reward model at ppo.reward_dir
ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp")         # ppo.advantage
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean")          # ppo.loss_aggregation (rlhf_cli.ppo.core)
KL_ESTIMATORS = ("k1", "k3", "abs", "mse")                   # ppo.kl_estimator, ppo.kl_loss_estimator
STOP_TOKENS = ("eos", None)                                  # ppo.stop_token; None: fixed-length responses
RECOMPUTE_LOGPROBS = ("auto", True, False)                   # ppo.recompute_logprobs

# ---- dpo: trl DPOConfig's loss types for pairs (its "sft" term is dpo.rpo_alpha; "aot_unpaired" is for unpaired data)
DPO_LOSSES = ("sigmoid", "ipo", "robust", "hinge", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
              "apo_zero", "apo_down", "discopop", "sigmoid_norm")

# ---- logging
REPORT_TO = ("tensorboard", "wandb")                         # logging.report_to (rlhf_cli.tracking)
WANDB_MODES = ("online", "offline", "disabled", None)        # logging.wandb.mode; None: WANDB_MODE or wandb's
