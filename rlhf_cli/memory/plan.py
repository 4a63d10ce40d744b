"""A stage's memory plan (`StagePlan`: its items, summed by kind) from the run's `Setup`, and the planners of sft,
reward and dpo; PPO's is rlhf_cli.memory.ppo_plan's."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_cli import quantization
from rlhf_cli.memory.arch import (
    FUSED_TILE,
    Arch,
    activations,
    causal_lm_params,
    fused_head_bytes,
    layer_working_bytes,
    lora_params,
    lora_targets,
    quantized_linears,
    seq_cls_params,
)
from rlhf_cli.precision import SHORT, precision

# Measured on a 2-core CPU box with the tiny recipe (torch 2.13, transformers 5.24, trl 1.16, peft 0.21,
# 1 thread) with bench/probes/rss_probe.py: peak RSS growth (after the stage's imports) minus the static tensors
# and the slack on the transient ones, fitted over runs of the recipe (sft and reward 5 steps, a full epoch, and
# micro-batch 1; ppo 64, 128 and 512 episodes, and with its evaluation in chunks of 32 and 64 prompts; runs of one
# configuration differ by up to ±20 MiB) - what a run allocates that no term above counts: library code imported
# on first use, tokenizer, data and datasets, the trainer, thread pools. They follow the stages' code: re-measure
# when a stage changes what it allocates (tests/test_doctor.py's slow test compares every stage with its plan).
# ppo's is 0: it imports no datasets (rlhf_cli.hardware.quiet_datasets), and its runs measured 64-73 MiB against
# 74 planned without evaluation, 86-109 against 97 with it.
# GPUs: CUDA context and the caching allocator's reserve, an assumption (no GPU to measure here).
# dpo: taken as sft's (the same trainer machinery and fused LM head), not fitted.
RUNTIME_OVERHEAD_MIB = {"cpu": {"sft": 64, "reward": 26, "ppo": 0, "dpo": 64},
                        "cuda": {"sft": 768, "reward": 768, "ppo": 768, "dpo": 768}}
# Peak RSS / peak live transient tensors: glibc's malloc raises its mmap threshold after frees, so freed
# activation and logits buffers stay resident (measured 1.9-2.2 on the tiny PPO runs). PyTorch's CUDA caching
# allocator fragments far less.
ALLOCATOR_SLACK = {"cpu": 2.0, "cuda": 1.1}
# PPO on the stock code (the fast paths off, sharded, or on an accelerator): transformers' generate() allocates its
# code's objects and caches at the first call (~10 MiB anonymous memory on the CPU; bench/results/NOTES.md has the
# tiny and real-shape measurements this allowance is checked against).
STOCK_RUNTIME_MIB = 12


@dataclass
class Item:
    name: str
    bytes: float
    note: str = ""
    kind: str = "static"   # static (held all run) | transient (a phase's peak) | offloaded (CPU memory)


# phases that run now and then between training steps (ppo.eval_every, <stage>.eval_steps), not at every step
OCCASIONAL = ("evaluation",)


@dataclass
class StagePlan:
    stage: str
    items: list[Item] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # transient phase -> bytes; the peak takes the max
    overhead: float = 0.0
    slack: float = 1.0
    notes: list[str] = field(default_factory=list)
    checkpoint: float = 0.0  # bytes of one training checkpoint on disk (0: the stage writes none)

    @property
    def static(self) -> float:
        return sum(i.bytes for i in self.items if i.kind == "static")

    @property
    def transient(self) -> float:
        return max(self.phases.values(), default=0.0)

    @property
    def offloaded(self) -> float:
        return sum(i.bytes for i in self.items if i.kind == "offloaded")

    @property
    def tensors(self) -> float:
        return self.static + self.transient

    @property
    def loop(self) -> float:
        """The transient peak of the phases every step repeats (all but OCCASIONAL ones)."""
        return max((v for k, v in self.phases.items() if k not in OCCASIONAL), default=0.0)

    @property
    def peak(self) -> float:
        """Peak memory of one process: tensors, the allocator's slack on the training loop's transient part (its
        buffers are freed and allocated again at every step, and the allocator keeps freed blocks), an occasional
        phase's excess over it once (it reuses those blocks), runtime overhead."""
        return self.static + self.slack * self.loop + max(0.0, self.transient - self.loop) + self.overhead


@dataclass(frozen=True)
class Lengths:
    """Token lengths of the training data (rendered as the stages render it), when `rlhf doctor` could read
    it and its tokenizer here; None: the plan takes the configured maximum."""
    prompt: int | None = None   # longest training prompt (chat template + assistant header)
    sft: int | None = None      # longest SFT row: prompt + answer + EOS (with sft_on_rejected, rejected too)
    reward: int | None = None   # longest chosen or rejected sequence of the reward data (dpo reads the same pairs)
    source: str = "no data read"  # what was tokenized, with what; or why nothing was


@dataclass(frozen=True)
class Setup:
    """What the plan depends on besides the architecture (read from the run's settings by `setup_from`)."""
    accelerator: str = "cpu"          # cpu | cuda
    strategy: str = "single"          # single | ddp | deepspeed | fsdp
    world: int = 1                    # processes over all machines
    per_machine: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    frozen_bytes: int = 4             # model.dtype: storage of frozen weights
    compute_bytes: int = 4            # device.mixed_precision: activations / logits
    dtype_name: str = "float32"
    compute_name: str = "fp32"
    lengths: Lengths = Lengths()
    quantization: str | None = None   # model.quantization: "4bit" / "8bit" frozen decoder linears; None: none


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def setup_from(run, visible_gpus: int = 0, lengths: Lengths | None = None) -> Setup:
    """`device.num_processes=auto` plans for the visible GPUs (8 when none is visible here)."""
    d = run.device
    # planned for the device the recipe names, whatever this machine has: a GPU with bf16 (fp16 is the same size)
    p = precision(run.model.dtype, d.mixed_precision, str(d.accelerator),
                  cuda_bf16=True if str(d.accelerator) == "cuda" else None)
    n = d.num_processes
    per_machine = (visible_gpus or 8) if str(n) == "auto" else int(n)
    strategy = str(d.strategy)
    zero = int(d.zero_stage) if strategy == "deepspeed" else 0
    return Setup(accelerator=str(d.accelerator), strategy=strategy, world=per_machine * int(d.num_machines),
                 per_machine=per_machine, zero_stage=zero, offload_optimizer=bool(d.offload_optimizer),
                 offload_params=bool(d.offload_params), frozen_bytes=DTYPE_BYTES[p.storage],
                 compute_bytes=DTYPE_BYTES[p.compute], dtype_name=p.storage, compute_name=SHORT[p.compute],
                 lengths=lengths or Lengths(), quantization=quantization.mode(run.model))


def prompt_tokens(run, s: Setup) -> tuple[int, str]:
    """(prompt length the plan uses, what it is): the data's longest prompt, else data.max_prompt_length
    (longer prompts are dropped by the stages, so it caps the data's figure too)."""
    cap = int(run.data.max_prompt_length)
    if s.lengths.prompt is None:
        return cap, f"data.max_prompt_length={cap}"
    return min(s.lengths.prompt, cap), f"the data's longest prompt; data.max_prompt_length={cap} caps it"


def sequence_tokens(run, stage: str, s: Setup) -> tuple[int, str]:
    """(sequence length the plan uses for sft / reward / dpo, what it is): the data's longest row cut at
    <stage>.max_length, else <stage>.max_length."""
    cap = int(run[stage].max_length)
    n = {"sft": s.lengths.sft, "reward": s.lengths.reward, "dpo": s.lengths.reward}[stage]
    if n is None:
        return cap, f"{stage}.max_length={cap}"
    return min(n, cap), f"the data's longest row; {stage}.max_length={cap} caps it"


def _shards(s: Setup) -> tuple[int, int, int]:
    """Divisors of (weights, gradients, optimizer states) under the strategy."""
    n = max(s.world, 1)
    if s.strategy == "fsdp":
        return n, n, n
    if s.strategy == "deepspeed":
        z = s.zero_stage
        return (n if z >= 3 else 1), (n if z >= 2 else 1), (n if z >= 1 else 1)
    return 1, 1, 1


def _div(n: int) -> str:
    return f" / {n}" if n > 1 else ""


def add_trainable(plan: StagePlan, s: Setup, name: str, params: float, label: str) -> float:
    """Weights, gradients and AdamW states of `params` trainable parameters. Returns the bytes of the
    compute-dtype copies autocast makes of them for a training step (0 without autocast)."""
    w_div, g_div, o_div = _shards(s)
    m = f"{params / 1e6:.2f}M"
    if s.strategy == "deepspeed":
        # DeepSpeed casts the module to the compute dtype and keeps fp32 master weights with the states
        cb = s.compute_bytes
        kind = "offloaded" if s.offload_params and w_div > 1 else "static"
        plan.items.append(Item(name, params * cb / w_div, f"{m} × {cb} B (DeepSpeed's compute-dtype module)"
                               + _div(w_div), kind))
        plan.items.append(Item(f"gradients ({label})", params * cb / g_div, f"{m} × {cb} B" + _div(g_div)))
        per = 8 + (4 if cb < 4 else 0)
        note = f"fp32 exp_avg + exp_avg_sq{' + fp32 master' if cb < 4 else ''} = {per} B/param{_div(o_div)}"
        kind = "offloaded" if s.offload_optimizer else "static"
        plan.items.append(Item(f"optimizer ({label})", params * per / o_div, note, kind))
        return 0.0
    kind = "offloaded" if s.offload_params and s.strategy == "fsdp" else "static"
    plan.items.append(Item(name, params * 4 / w_div, f"{m} × 4 B (trainable: fp32){_div(w_div)}", kind))
    plan.items.append(Item(f"gradients ({label})", params * 4 / g_div, f"{m} × 4 B{_div(g_div)}"))
    if s.strategy == "ddp" and s.world > 1:
        plan.items.append(Item(f"DDP buckets ({label})", params * 4,
                               "a second gradient copy for all-reduce"))
    plan.items.append(Item(f"optimizer ({label})", params * 8 / o_div,
                           f"AdamW exp_avg + exp_avg_sq in fp32 = 8 B/param{_div(o_div)}"))
    # FSDP casts one layer's gathered parameters at a time: no whole-model copy
    return params * s.compute_bytes if s.compute_bytes < 4 and s.strategy != "fsdp" else 0.0


def add_frozen(plan: StagePlan, s: Setup, name: str, params: float, sharded: bool = False,
            a: Arch | None = None) -> None:
    """Frozen weights in model.dtype. `sharded`: part of the module ZeRO-3 / FSDP shard (frozen models of
    their own, such as PPO's reward model, stay whole); DeepSpeed holds them in its compute dtype. `a`: a model
    `model.quantization` quantizes, of this architecture (its decoder's linear layers: `quantized_linears`)."""
    if a is not None and s.quantization:
        weights, rows = quantized_linears(a)
        rest = params - weights
        plan.items.append(Item(name, rest * s.frozen_bytes + quantization.linear_bytes(s.quantization, weights, rows),
                               f"{weights / 1e6:.2f}M decoder linear weights × {quantization.describe(s.quantization)}"
                               f" + {rest / 1e6:.2f}M × {s.frozen_bytes} B (frozen, model.dtype)"))
        return
    div = _shards(s)[0] if sharded else 1
    nbytes = s.compute_bytes if sharded and s.strategy == "deepspeed" else s.frozen_bytes
    kind = "offloaded" if (s.offload_params and div > 1) else "static"
    what = "model.dtype" if nbytes == s.frozen_bytes else "compute dtype"
    plan.items.append(Item(name, params * nbytes / div, f"{params / 1e6:.2f}M × {nbytes} B (frozen, {what})"
                           + _div(div), kind))


def casts_trainable(s: Setup) -> bool:
    """Whether layers cast their inputs under autocast (DeepSpeed runs the whole module in the compute
    dtype)."""
    return s.compute_bytes < 4 and s.strategy != "deepspeed"


def plan_sft(run, a: Arch, s: Setup) -> StagePlan:
    st = run.sft
    plan = StagePlan("sft")
    cb = s.compute_bytes
    p = causal_lm_params(a)
    if bool(st.lora.enabled):
        add_frozen(plan, s, "policy base", p, sharded=True, a=a)
        targets, r = lora_targets(st.lora.target_modules), int(st.lora.r)
        copies = add_trainable(plan, s, "LoRA adapter", lora_params(a, r, targets), "LoRA")
        kw = {"trainable": False, "lora": targets, "r": r, "residual_bytes": s.frozen_bytes}
    else:
        copies = add_trainable(plan, s, "policy weights", p, "policy")
        kw = {"trainable": True, "residual_bytes": cb if s.strategy == "deepspeed" else 4}
    b = int(st.per_device_train_batch_size)
    t, t_note = sequence_tokens(run, "sft", s)
    plan.notes.append(f"sequence length {t} tokens: {t_note}")
    ckpt = bool(st.activation_checkpointing)
    act = activations(a, b, t, cb, ckpt, cast=casts_trainable(s), **kw)
    lora_head = bool(st.lora.enabled) and "lm_head" in lora_targets(st.lora.target_modules)
    logits = fused_head_bytes(a, b * t, cb, s.accelerator, True, not bool(st.lora.enabled) or lora_head)
    plan.items.append(Item("activations", act, f"micro-batch {b} × {t} tokens × {a.num_hidden_layers} layers"
                           + (" (checkpointed)" if ckpt else ""), "transient"))
    plan.items.append(Item("LM head (fused, tiled)", logits, f"trl's fused LM head over {b}·{t} tokens: "
                           f"tiles of ≤ {FUSED_TILE[0]}×{FUSED_TILE[1]} logits, never the whole (B, T, V)",
                           "transient"))
    if copies:
        plan.items.append(Item("autocast weight copies", copies, f"trainable weights × {cb} B for a step",
                               "transient"))
    plan.phases["training step"] = act + logits + copies
    # evaluation (no gradients): one layer's working set at a time, and the fused LM head
    be = int(st.per_device_eval_batch_size)
    ev = be * t * layer_working_bytes(a, cb) + fused_head_bytes(a, be * t, cb, s.accelerator, False, False)
    plan.items.append(Item("evaluation", ev, f"eval batch {be} × {t} tokens: one layer + the fused LM head",
                           "transient"))
    plan.phases["evaluation"] = ev
    return plan


def plan_reward(run, a: Arch, s: Setup) -> StagePlan:
    st = run.reward
    plan = StagePlan("reward")
    cb = s.compute_bytes
    copies = add_trainable(plan, s, "reward model weights", seq_cls_params(a), "reward model")
    kw = {"trainable": True, "residual_bytes": cb if s.strategy == "deepspeed" else 4, "cast": casts_trainable(s)}
    b, be = 2 * int(st.per_device_train_batch_size), 2 * int(st.per_device_eval_batch_size)
    t, t_note = sequence_tokens(run, "reward", s)
    plan.notes.append(f"sequence length {t} tokens: {t_note}")
    ckpt = bool(st.activation_checkpointing)
    act = activations(a, b, t, cb, ckpt, **kw)
    note = f"{b} sequences (chosen + rejected) × {t} tokens × {a.num_hidden_layers} layers"
    plan.items.append(Item("activations", act, note + (" (checkpointed)" if ckpt else ""), "transient"))
    if copies:
        plan.items.append(Item("autocast weight copies", copies, f"trainable weights × {cb} B for a step",
                               "transient"))
    plan.phases["training step"] = act + copies
    # evaluation and the score statistics (no gradients): one layer at a time
    ev = be * t * layer_working_bytes(a, cb)
    plan.items.append(Item("evaluation", ev, f"{be} sequences × {t} tokens: one layer", "transient"))
    plan.phases["evaluation"] = ev
    return plan


def plan_dpo(run, a: Arch, s: Setup) -> StagePlan:
    """trl's DPOTrainer: each step runs the policy on chosen + rejected (2 × micro-batch sequences) with
    gradients, then, while those activations are held, the reference on the same sequences without them (with
    LoRA the policy with its adapter disabled, else a frozen copy in model.dtype), both through trl's fused LM
    head; then the backward."""
    st = run.dpo
    plan = StagePlan("dpo")
    cb = s.compute_bytes
    p = causal_lm_params(a)
    lora = bool(st.lora.enabled)
    if lora:
        add_frozen(plan, s, "policy base", p, sharded=True, a=a)
        plan.items.append(Item("reference", 0, "the policy base with its adapter disabled"))
        targets, r = lora_targets(st.lora.target_modules), int(st.lora.r)
        copies = add_trainable(plan, s, "LoRA adapter", lora_params(a, r, targets), "LoRA")
        kw = {"trainable": False, "lora": targets, "r": r, "residual_bytes": s.frozen_bytes}
        plan.checkpoint = lora_params(a, r, targets) * (4 + 8)
    else:
        copies = add_trainable(plan, s, "policy weights", p, "policy")
        add_frozen(plan, s, "reference weights", p, sharded=True)
        kw = {"trainable": True, "residual_bytes": cb if s.strategy == "deepspeed" else 4}
        plan.checkpoint = p * (4 + 8)
    b, be = 2 * int(st.per_device_train_batch_size), 2 * int(st.per_device_eval_batch_size)
    t, t_note = sequence_tokens(run, "dpo", s)
    plan.notes.append(f"sequence length {t} tokens: {t_note}")
    ckpt = bool(st.activation_checkpointing)
    act = activations(a, b, t, cb, ckpt, cast=casts_trainable(s), **kw)
    head = fused_head_bytes(a, b * t, cb, s.accelerator, True, not lora)
    reference = b * t * layer_working_bytes(a, cb) + fused_head_bytes(a, b * t, cb, s.accelerator, False, False)
    note = f"{b} sequences (chosen + rejected) × {t} tokens × {a.num_hidden_layers} layers"
    plan.items.append(Item("activations", act, note + (" (checkpointed)" if ckpt else ""), "transient"))
    plan.items.append(Item("LM head (fused, tiled)", head, f"trl's fused LM head over {b}·{t} tokens",
                           "transient"))
    plan.items.append(Item("reference forward", reference, f"{b} sequences, no gradients: one layer + the fused "
                           "LM head, while the policy's activations are held", "transient"))
    if copies:
        plan.items.append(Item("autocast weight copies", copies, f"trainable weights × {cb} B for a step",
                               "transient"))
    plan.phases["training step"] = act + max(head, reference) + copies
    # evaluation: the policy's forward, then the reference's, neither with gradients
    ev = be * t * layer_working_bytes(a, cb) + fused_head_bytes(a, be * t, cb, s.accelerator, False, False)
    plan.items.append(Item("evaluation", ev, f"{be} sequences × {t} tokens: one layer + the fused LM head",
                           "transient"))
    plan.phases["evaluation"] = ev
    return plan


# the stages doctor.stages may name
