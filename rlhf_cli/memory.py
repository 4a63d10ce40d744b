"""Memory plan of a recipe: bytes per process for each training stage, from the model's config values.

Pure Python (no torch): `rlhf doctor` answers in seconds. Sizes are estimates of what each process holds at
its peak; every term is listed so that a plan can be checked by hand.

Parameters (Qwen3 / Llama-style decoder: RMSNorm, grouped-query attention, SwiGLU MLP)
    embeddings V·h; per layer q h·(n_h·d) + k, v h·(n_kv·d) each + o (n_h·d)·h + MLP 3·h·i + norms 2h (+ 2d
    q/k norms); final norm h; LM head V·h unless tied. The reward / value model is the same backbone with a
    1-output score head (h) instead of the LM head. LoRA adds r·(in + out) per adapted linear layer
    ("all-linear": q, k, v, o, gate, up, down; the LM head only when named), kept in fp32 by peft.

Training state, per trainable parameter (p = bytes of the trainable weights)
    gradients p (DDP adds its communication buckets: p again); AdamW exp_avg + exp_avg_sq: 2p (torch keeps
    them in the parameter dtype); DeepSpeed keeps fp32 states and, with 16-bit weights, an fp32 master copy:
    8 + 4 bytes. ZeRO-1/2 divide optimizer states (and ZeRO-2 the gradients) by the number of processes,
    ZeRO-3 and FSDP divide weights, gradients and states; offload moves states (and ZeRO-3 parameters) to CPU
    memory.

Activations kept for the backward pass, per token per decoder layer, in elements (q = n_h·d, kv = n_kv·d)
    attention: norm input and output 2h, q/k before and after their norms 2(q + kv), v kv, rotated q/k q + kv,
    attention output q, o-projection input q                              -> 2h + 5q + 4kv
    MLP: norm input and output 2h, gate, SiLU(gate), up, product 4i        -> 2h + 4i
    so a = 4h + 5q + 4kv + 4i (SDPA kernels keep no T×T score matrix; eager attention would add n_h·T).
    With activation checkpointing only each layer's input (h) is kept, plus one layer's full set during
    recomputation. Times micro-batch × sequence length × layers × bytes of the compute dtype.
Logits: B·T·V for the LM head output, plus its fp32 copy and log-softmax for the loss (4 + 4 bytes).
Generation (PPO rollout, no gradients) of F sequences of S = prompt + response tokens
    KV cache 2·L·n_kv·d·F·S; the R sampled steps' logits (F·R·V) stacked, and the temperature-scaled,
    log-softmax and entropy temporaries of the log-prob pass: 5·F·R·V·4 bytes; with a LoRA policy, the merged
    copy of each adapted weight that sampling runs on.

Runtime overhead (measured, see RUNTIME_OVERHEAD_MIB and ALLOCATOR_SLACK): on the CPU, what a stage allocates
besides tensors (library code imported on first use, tokenizer, data, thread pools) and glibc's habit of
keeping freed large blocks (peak RSS ≈ 2 × the transient tensors); on a GPU the CUDA context and the caching
allocator.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

GiB = 2**30
MiB = 2**20
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Measured on a 2-core CPU box with the tiny recipe (torch 2.13, transformers 5.24, trl 1.16, 1 thread) with
# tests/rss_probe.py: peak RSS growth (after the stage's imports) of a run with micro-batch 1 and the shortest
# lengths, minus its tensors (models, optimizer) - what a run allocates that no term above counts: library
# code imported on first use, tokenizer, data and datasets, the trainer, thread pools. GPUs: CUDA context and
# the caching allocator's reserve, an assumption (no GPU to measure here).
RUNTIME_OVERHEAD_MIB = {"cpu": {"sft": 97, "reward": 63, "ppo": 118},
                        "cuda": {"sft": 768, "reward": 768, "ppo": 768}}
# Peak RSS / peak live transient tensors: glibc's malloc raises its mmap threshold after frees, so freed
# activation and logits buffers stay resident (measured 1.9-2.2 on the tiny PPO runs). PyTorch's CUDA caching
# allocator fragments far less.
ALLOCATOR_SLACK = {"cpu": 2.0, "cuda": 1.1}


@dataclass(frozen=True)
class Arch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool = True  # Qwen3 normalises q and k per head

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


# Published config.json values of known models, used when no config.json can be read (no network here).
KNOWN_ARCHS = {
    "Qwen/Qwen3-0.6B": Arch(151936, 1024, 3072, 28, 16, 8, 128, True),
    "Qwen/Qwen3-1.7B": Arch(151936, 2048, 6144, 28, 16, 8, 128, True),
    "Qwen/Qwen3-4B": Arch(151936, 2560, 9728, 36, 32, 8, 128, True),
    "Qwen/Qwen3-8B": Arch(151936, 4096, 12288, 36, 32, 8, 128, False),
}


def arch_from_config(d: dict) -> Arch:
    """From a transformers config.json dict (Qwen2/3, Llama, Mistral keys)."""
    d = d.get("text_config", d)
    heads = int(d["num_attention_heads"])
    head_dim = int(d.get("head_dim") or d["hidden_size"] // heads)
    return Arch(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=head_dim, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qk_norm=str(d.get("model_type", "")).startswith("qwen3"))


def _cached_config_files(name: str, cache_dir: str | None) -> list[Path]:
    """config.json of a hub id in the local ModelScope / Hugging Face caches (no network)."""
    org_name = name.replace("/", "--")
    roots = [Path(cache_dir).expanduser()] if cache_dir else []
    ms = os.environ.get("MODELSCOPE_CACHE") or str(Path.home() / ".cache" / "modelscope" / "hub")
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hf = os.environ.get("HF_HUB_CACHE") or str(hf_home / "hub")
    roots += [Path(ms), Path(hf)]
    found = []
    for root in roots:
        found += [root / name / "config.json", root / "models" / name / "config.json"]
        found += sorted((root / "models" / org_name / "snapshots").glob("*/config.json"))
        found += sorted((root / f"models--{org_name}" / "snapshots").glob("*/config.json"))
    return [p for p in found if p.is_file()]


def arch_for_model(model_cfg) -> tuple[Arch, str]:
    """(architecture, where its values came from): the tiny config, a config.json, or the built-in table."""
    name = str(model_cfg.name_or_path)
    if name == "tiny":
        t = model_cfg.tiny
        # the tokenizer trained on the demo data can come out a little smaller than vocab_size: an upper bound
        return Arch(int(t.vocab_size), int(t.hidden_size), int(t.intermediate_size), int(t.num_hidden_layers),
                    int(t.num_attention_heads), int(t.num_key_value_heads), int(t.head_dim), True), \
            "model.tiny (conf/model/tiny.yaml)"
    local = Path(name).expanduser() / "config.json"
    files = [local] if local.is_file() else _cached_config_files(name, model_cfg.get("cache_dir"))
    for f in files:
        try:
            return arch_from_config(json.loads(f.read_text(encoding="utf-8"))), str(f)
        except (OSError, ValueError, KeyError):
            continue
    if name in KNOWN_ARCHS:
        return KNOWN_ARCHS[name], f"built-in table (no config.json of {name} readable here)"
    raise ValueError(f"no config.json for {name} (not a local directory, not in the hub caches) and it is "
                     f"not in the built-in table ({', '.join(KNOWN_ARCHS)}); point model.name_or_path at a "
                     "model directory")


# --------------------------------------------------------------------------------------------- parameters
def linear_shapes(a: Arch) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer."""
    h, q, kv, i = a.hidden_size, a.q_dim, a.kv_dim, a.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def backbone_params(a: Arch) -> int:
    per_layer = sum(i * o for i, o in linear_shapes(a).values()) + 2 * a.hidden_size
    if a.qk_norm:
        per_layer += 2 * a.head_dim
    return a.vocab_size * a.hidden_size + a.num_hidden_layers * per_layer + a.hidden_size


def causal_lm_params(a: Arch) -> int:
    return backbone_params(a) + (0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size)


def seq_cls_params(a: Arch) -> int:
    return backbone_params(a) + a.hidden_size  # score head, 1 output, no bias


def lora_params(a: Arch, r: int, target_modules) -> int:
    targets = LORA_TARGETS if str(target_modules) == "all-linear" else \
        [t for t in ([target_modules] if isinstance(target_modules, str) else list(target_modules))]
    shapes = linear_shapes(a)
    per_layer = sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)
    head = r * (a.hidden_size + a.vocab_size) if "lm_head" in targets else 0  # the output layer, once
    return a.num_hidden_layers * per_layer + head


def activation_elements_per_token_layer(a: Arch) -> int:
    """a = 4h + 5q + 4kv + 4i (see the module docstring)."""
    return 4 * a.hidden_size + 5 * a.q_dim + 4 * a.kv_dim + 4 * a.intermediate_size


# ------------------------------------------------------------------------------------------------- the plan
@dataclass
class Item:
    name: str
    bytes: float
    note: str = ""
    kind: str = "static"   # static (held all run) | transient (a phase's peak) | offloaded (CPU memory)


@dataclass
class StagePlan:
    stage: str
    items: list[Item] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # transient phase -> bytes; the peak takes the max
    overhead: float = 0.0
    slack: float = 1.0
    notes: list[str] = field(default_factory=list)

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
    def peak(self) -> float:
        """Peak memory of one process: tensors, allocator slack on the transient part, runtime overhead."""
        return self.static + self.slack * self.transient + self.overhead


@dataclass(frozen=True)
class Setup:
    """What the plan depends on besides the architecture (read from the composed config by `setup_from`)."""
    accelerator: str = "cpu"          # cpu | cuda
    strategy: str = "single"          # single | ddp | deepspeed | fsdp
    world: int = 1                    # processes over all machines
    per_machine: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    weight_bytes: int = 4             # dtype the weights load in
    compute_bytes: int = 4            # activations / logits dtype
    dtype_name: str = "float32"


def setup_from(cfg, visible_gpus: int = 0) -> Setup:
    """`device.num_processes=auto` plans for the visible GPUs (8 when none is visible here)."""
    d, m = cfg.device, cfg.model
    acc = str(d.accelerator)
    dtype = str(m.dtype)
    if dtype in ("auto", "None"):
        dtype = "bfloat16" if acc == "cuda" else "float32"
    wb = 4 if dtype == "float32" else 2
    n = d.num_processes
    per_machine = (visible_gpus or 8) if str(n) == "auto" else int(n)
    strategy = str(d.get("strategy") or "single")
    zero = int(d.get("zero_stage") or 0) if strategy == "deepspeed" else 0
    return Setup(accelerator=acc, strategy=strategy, world=per_machine * int(d.get("num_machines") or 1),
                 per_machine=per_machine, zero_stage=zero, offload_optimizer=bool(d.get("offload_optimizer")),
                 offload_params=bool(d.get("offload_params")), weight_bytes=wb, compute_bytes=wb,
                 dtype_name=dtype)


def _shards(s: Setup) -> tuple[int, int, int]:
    """Divisors of (weights, gradients, optimizer states) under the strategy."""
    n = max(s.world, 1)
    if s.strategy == "fsdp":
        return n, n, n
    if s.strategy == "deepspeed":
        z = s.zero_stage
        return (n if z >= 3 else 1), (n if z >= 2 else 1), (n if z >= 1 else 1)
    return 1, 1, 1


def _train_state(plan: StagePlan, s: Setup, trainable: float, tbytes: int, label: str) -> None:
    """Gradients and AdamW states of `trainable` parameters stored in `tbytes` bytes each."""
    _, g_div, o_div = _shards(s)
    grads = trainable * tbytes / g_div
    plan.items.append(Item(f"gradients ({label})", grads, f"{trainable / 1e6:.2f}M × {tbytes} B"
                           + (f" / {g_div}" if g_div > 1 else "")))
    if s.strategy == "ddp" and s.world > 1:
        plan.items.append(Item("DDP gradient buckets", trainable * tbytes,
                               "a second gradient copy for all-reduce"))
    if s.strategy == "deepspeed":
        per = 8 + (4 if tbytes < 4 else 0)
        note = f"fp32 exp_avg + exp_avg_sq{' + fp32 master' if tbytes < 4 else ''} = {per} B/param / {o_div}"
    else:
        per = 2 * tbytes
        note = f"AdamW exp_avg + exp_avg_sq in the parameter dtype = {per} B/param" + \
            (f" / {o_div}" if o_div > 1 else "")
    kind = "offloaded" if s.offload_optimizer and s.strategy == "deepspeed" else "static"
    plan.items.append(Item(f"optimizer ({label})", trainable * per / o_div, note, kind))


def _weights(plan: StagePlan, s: Setup, name: str, params: float, frozen: bool = False) -> None:
    w_div = _shards(s)[0]
    # ZeRO-3 / FSDP shard what the optimizer trains; frozen models (PPO's reward model) stay whole
    div = 1 if frozen else w_div
    kind = "offloaded" if (s.offload_params and div > 1) else "static"
    note = f"{params / 1e6:.2f}M × {s.weight_bytes} B" + (f" / {div}" if div > 1 else "")
    plan.items.append(Item(name, params * s.weight_bytes / div, note, kind))


def _activations(a: Arch, batch: int, seq: int, nbytes: int, checkpointing: bool) -> float:
    per_tok_layer = activation_elements_per_token_layer(a)
    if checkpointing:
        return batch * seq * nbytes * (a.num_hidden_layers * a.hidden_size + per_tok_layer)
    return batch * seq * nbytes * a.num_hidden_layers * per_tok_layer


def plan_sft(cfg, a: Arch, s: Setup) -> StagePlan:
    st = cfg.sft
    plan = StagePlan("sft")
    p = causal_lm_params(a)
    _weights(plan, s, "policy weights", p)
    lora = bool(st.lora.enabled)
    if lora:
        pl = lora_params(a, int(st.lora.r), st.lora.target_modules)
        plan.items.append(Item("LoRA adapter", pl * 4, f"{pl / 1e6:.2f}M × 4 B (fp32)"))
        _train_state(plan, s, pl, 4, "LoRA")
    else:
        _train_state(plan, s, p, s.weight_bytes, "policy")
    b, t = int(st.per_device_train_batch_size), int(st.max_length)
    ckpt = bool(st.get("activation_checkpointing"))
    act = _activations(a, b, t, s.compute_bytes, ckpt)
    logits = b * t * a.vocab_size * (s.compute_bytes + 8)
    plan.items.append(Item("activations", act, f"micro-batch {b} × {t} tokens × {a.num_hidden_layers} layers"
                           + (" (checkpointed)" if ckpt else ""), "transient"))
    plan.items.append(Item("logits", logits, f"{b}·{t}·{a.vocab_size} × ({s.compute_bytes} + 4 + 4) B",
                           "transient"))
    plan.phases["training step"] = act + logits
    # evaluation (no gradients): one layer's activations at a time, logits with the loss and trl's entropy /
    # token-accuracy temporaries
    be = int(st.per_device_eval_batch_size)
    per_token = (activation_elements_per_token_layer(a) * s.compute_bytes
                 + a.vocab_size * (s.compute_bytes + 8))
    ev = be * t * per_token
    plan.items.append(Item("evaluation", ev, f"eval batch {be} × {t} tokens: one layer + logits",
                           "transient"))
    plan.phases["evaluation"] = ev
    return plan


def plan_reward(cfg, a: Arch, s: Setup) -> StagePlan:
    st = cfg.reward
    plan = StagePlan("reward")
    p = seq_cls_params(a)
    _weights(plan, s, "reward model weights", p)
    _train_state(plan, s, p, s.weight_bytes, "reward model")
    b, t = 2 * int(st.per_device_train_batch_size), int(st.max_length)  # chosen + rejected in one forward
    ckpt = bool(st.get("activation_checkpointing"))
    act = _activations(a, b, t, s.compute_bytes, ckpt)
    note = f"{b} sequences (chosen + rejected) × {t} tokens × {a.num_hidden_layers} layers"
    plan.items.append(Item("activations", act, note + (" (checkpointed)" if ckpt else ""), "transient"))
    plan.phases["training step"] = act
    return plan


def plan_ppo(cfg, a: Arch, s: Setup) -> StagePlan:
    p = cfg.ppo
    plan = StagePlan("ppo")
    pl, pc = causal_lm_params(a), seq_cls_params(a)
    # ppo runs under ddp only
    ps = replace(s, strategy="ddp" if s.world > 1 else "single", zero_stage=0)
    _weights(plan, ps, "policy weights", pl)
    if bool(p.lora.enabled):
        n_lora = lora_params(a, int(p.lora.r), p.lora.target_modules)
        plan.items.append(Item("LoRA adapter", n_lora * 4, f"{n_lora / 1e6:.2f}M × 4 B (fp32)"))
        plan.items.append(Item("reference", 0, "the policy with its adapter disabled"))
        _train_state(plan, ps, n_lora, 4, "LoRA")
    else:
        _weights(plan, ps, "reference weights", pl, frozen=True)
        _train_state(plan, ps, pl, ps.weight_bytes, "policy")
    _weights(plan, ps, "value model weights", pc)
    if bool(p.value_lora):
        nv = lora_params(a, int(p.lora.r), p.lora.target_modules) + a.hidden_size
        plan.items.append(Item("value LoRA adapter", nv * 4, f"{nv / 1e6:.2f}M × 4 B"))
        _train_state(plan, ps, nv, 4, "value LoRA")
    else:
        _train_state(plan, ps, pc, ps.weight_bytes, "value model")
    _weights(plan, ps, "reward model weights", pc, frozen=True)

    b = int(p.per_device_train_batch_size)
    r = int(p.response_length)
    seq = int(cfg.data.max_prompt_length) + r
    local_batch = b * int(p.gradient_accumulation_steps) * int(p.num_mini_batches)
    f = min(int(p.rollout_forward_batch_size), local_batch)
    cb = ps.compute_bytes
    buffer = local_batch * (seq * 8 * 3 + r * (8 + 4 * 6))
    plan.items.append(Item("rollout buffer", buffer, f"{local_batch} episodes × {seq} tokens (ids, masks, "
                           "log-probs, values, rewards)"))
    kv = 2 * a.num_hidden_layers * a.kv_dim * f * seq * cb
    # the sampling loop (ppo.rollout.sample_loop) keeps no per-step logits: one step's (f, V) logits and their
    # log-prob / entropy temporaries are alive at a time
    gen_logits = 5 * f * a.vocab_size * 4
    plan.items.append(Item("KV cache", kv, f"2·{a.num_hidden_layers} layers·{a.kv_dim}·{f} seqs·{seq} tokens "
                           f"× {cb} B", "transient"))
    plan.items.append(Item("generation logits", gen_logits, f"5 × {f}·{a.vocab_size} × 4 B (one step's "
                           "logits, log-prob / entropy temporaries)", "transient"))
    act = _activations(a, b, seq, cb, False)
    logits = b * r * a.vocab_size * (cb + 4) + 3 * b * r * a.vocab_size * 4
    plan.items.append(Item("policy activations", act, f"micro-batch {b} × {seq} tokens × "
                           f"{a.num_hidden_layers} layers", "transient"))
    plan.items.append(Item("value activations", act, "same shape as the policy's", "transient"))
    plan.items.append(Item("policy logits", logits, f"{b}·{r}·{a.vocab_size} × ({cb} + 4) B + entropy "
                           "temporaries", "transient"))
    merged = 0
    if bool(p.lora.enabled):
        # sampling runs on the LoRA merged into a copy of each adapted weight (ppo.rollout.lora_merged)
        shapes = linear_shapes(a)
        targets = LORA_TARGETS if str(p.lora.target_modules) == "all-linear" else list(p.lora.target_modules)
        merged = a.num_hidden_layers * sum(shapes[t][0] * shapes[t][1] for t in targets if t in shapes) * cb
        if "lm_head" in targets:
            merged += a.hidden_size * a.vocab_size * cb
        plan.items.append(Item("merged LoRA weights", merged, "sampling uses W + B·A copies of the adapted "
                               "weights", "transient"))
    plan.phases["rollout"] = kv + gen_logits + merged
    plan.phases["training step"] = 2 * act + logits
    return plan


PLANNERS = {"sft": plan_sft, "reward": plan_reward, "ppo": plan_ppo}


def plan_stage(cfg, stage: str, a: Arch, s: Setup | None = None) -> StagePlan:
    s = s or setup_from(cfg)
    plan = PLANNERS[stage](cfg, a, s)
    kind = "cuda" if s.accelerator == "cuda" else "cpu"
    plan.overhead = RUNTIME_OVERHEAD_MIB[kind][stage] * MiB
    plan.slack = ALLOCATOR_SLACK[kind]
    return plan


# --------------------------------------------------------------------------------------------------- advice
def _with(cfg, **dotted):
    from omegaconf import OmegaConf

    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(c, False)
    for k, v in dotted.items():
        OmegaConf.update(c, k.replace("__", "."), v, merge=True)
    return c


def _changes(cfg, stage: str, s: Setup) -> list[tuple[dict, dict]]:
    """Single changes that can lower a stage's peak: ({config key: value}, {Setup field: value})."""
    st = cfg[stage]
    out: list[tuple[dict, dict]] = []
    b = int(st.per_device_train_batch_size)
    if b > 1:  # half the micro-batch, twice the accumulation: the same batch per optimizer step
        out.append(({f"{stage}.per_device_train_batch_size": b // 2,
                     f"{stage}.gradient_accumulation_steps": int(st.gradient_accumulation_steps) * 2}, {}))
    if stage == "sft" and int(st.per_device_eval_batch_size) > 1:
        out.append(({"sft.per_device_eval_batch_size": max(int(st.per_device_eval_batch_size) // 2, 1)}, {}))
    if stage in ("sft", "reward"):
        if not bool(st.get("activation_checkpointing")):
            out.append(({f"{stage}.activation_checkpointing": True}, {}))
        if s.accelerator == "cuda":
            n = max(s.per_machine, 2)
            many = {"world": n * max(s.world // max(s.per_machine, 1), 1), "per_machine": n}
            for kw in (dict(strategy="deepspeed", zero_stage=2), dict(strategy="deepspeed", zero_stage=3),
                       dict(strategy="fsdp", zero_stage=0)):
                if (s.strategy, s.zero_stage) != (kw["strategy"], kw["zero_stage"]):
                    out.append(({}, {**many, **kw}))
            offloaded = s.offload_optimizer and s.offload_params
            if s.strategy == "deepspeed" and s.zero_stage == 3 and not offloaded:
                out.append(({}, {"offload_optimizer": True, "offload_params": True}))
    if stage == "ppo":
        f = int(st.rollout_forward_batch_size)
        if f > 1:
            out.append(({"ppo.rollout_forward_batch_size": f // 2}, {}))
        if not bool(st.value_lora):
            out.append(({"ppo.value_lora": True}, {}))
    return out


def _apply(cfg, s: Setup, keys: dict, fields: dict):
    return (_with(cfg, **{k.replace(".", "__"): v for k, v in keys.items()}) if keys else cfg), \
        (replace(s, **fields) if fields else s)


def _device_label(s: Setup) -> list[str]:
    name = {"deepspeed": f"zero{s.zero_stage}", "fsdp": "fsdp", "ddp": "ddp"}.get(s.strategy, "cuda")
    out = [f"device={name}", f"device.num_processes={s.per_machine}"]
    if s.offload_optimizer:
        out.append("device.offload_optimizer=true")
    if s.offload_params:
        out.append("device.offload_params=true")
    return out


def remedies(cfg, stage: str, a: Arch, s: Setup, budget: float) -> tuple[list[tuple[str, StagePlan]],
                                                                           tuple[str, StagePlan] | None]:
    """(single changes whose plan fits `budget`, else a greedy combination that fits - or None)."""
    singles = []
    for keys, fields in _changes(cfg, stage, s):
        c, s2 = _apply(cfg, s, keys, fields)
        p = plan_stage(c, stage, a, s2)
        if p.peak <= budget:
            label = " ".join([f"{k}={str(v).lower()}" for k, v in keys.items()]
                             + (_device_label(s2) if fields else []))
            singles.append((label, p))
    if singles:
        return sorted(singles, key=lambda x: x[1].peak, reverse=True), None
    c, s2, chosen = cfg, s, {}
    current = plan_stage(c, stage, a, s2).peak
    for _ in range(12):
        options = []
        for keys, fields in _changes(c, stage, s2):
            c3, s3 = _apply(c, s2, keys, fields)
            options.append((plan_stage(c3, stage, a, s3).peak, keys, c3, s3))
        if not options:
            break
        peak, keys, c3, s3 = min(options, key=lambda o: o[0])
        if peak >= current:
            break
        c, s2, current = c3, s3, peak
        chosen.update(keys)
        if current <= budget:
            label = " ".join([f"{k}={str(v).lower()}" for k, v in chosen.items()]
                             + (_device_label(s2) if s2 != s else []))
            return [], (label, plan_stage(c, stage, a, s2))
    return [], None


def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n else "0"


def format_plan(plan: StagePlan) -> list[str]:
    lines = [f"  {plan.stage}"]
    for it in plan.items:
        tag = {"transient": " (peak of a phase)", "offloaded": " (CPU memory)"}.get(it.kind, "")
        lines.append(f"    {it.name:<28}{fmt_bytes(it.bytes):>12}  {it.note}{tag}")
    phase = max(plan.phases, key=plan.phases.get) if plan.phases else "-"
    lines.append(f"    {'tensors at peak':<28}{fmt_bytes(plan.tensors):>12}  static "
                 f"{fmt_bytes(plan.static)} + {phase} {fmt_bytes(plan.transient)}")
    lines.append(f"    {'runtime overhead':<28}{fmt_bytes(plan.peak - plan.tensors):>12}  "
                 f"{fmt_bytes(plan.overhead)} measured constant + allocator slack ×{plan.slack:g} on the "
                 "transient part")
    lines.append(f"    {'peak per process':<28}{fmt_bytes(plan.peak):>12}")
    return lines
