"""Memory plan of a recipe: bytes per process for each training stage, from the model's config values.

Pure Python (no torch): `rlhf doctor` answers in seconds. Sizes are estimates of what each process holds at
its peak; every term is listed so that a plan can be checked by hand.

Parameters (Qwen3 / Llama-style decoder: RMSNorm, grouped-query attention, SwiGLU MLP)
    embeddings V·h; per layer q h·(n_h·d) + k, v h·(n_kv·d) each + o (n_h·d)·h + MLP 3·h·i + norms 2h (+ 2d
    q/k norms); final norm h; LM head V·h unless tied. The reward / value model is the same backbone with a
    1-output score head (h) instead of the LM head. LoRA adds r·(in + out) per adapted linear layer
    ("all-linear": q, k, v, o, gate, up, down; the LM head only when named, and never on a value model).

Precision (rlhf_cli.precision, the rule models.resolve_precision applies too)
    `model.dtype` (wb) stores FROZEN weights: the PPO policy's base (with its adapter disabled, also the
    reference), the reward model, a LoRA value model's trunk. `device.mixed_precision` (cb) is the compute
    dtype of activations and logits (autocast). Every TRAINABLE parameter is fp32 with fp32 gradients and
    AdamW states, 4 + 4 + 8 bytes, so a full fine-tune stores fp32 weights even when model.dtype is bf16;
    under autocast each training step also holds a cb copy of every trainable weight (cast once per forward,
    kept for its backward). DDP adds its communication buckets (4 bytes per trainable parameter). DeepSpeed
    runs the module in the compute dtype and keeps an fp32 master copy and fp32 states: cb + cb + 12 bytes.
    ZeRO-1/2 divide optimizer states (and ZeRO-2 the gradients) by the number of processes, ZeRO-3 and FSDP
    divide weights, gradients and states; offload moves states (and ZeRO-3 parameters) to CPU memory.
    `model.quantization` (rlhf_cli.quantization) stores the decoder's linear layers of the frozen models that
    are quantized (a LoRA policy's base, a LoRA value trunk, PPO's reward model) in nf4, 0.5 B + a 4 B absmax
    per 64 weights = 0.5625 B/weight, or int8, 1 B/weight + a 4 B scale per output row; their embeddings,
    norms and output layers stay in model.dtype.

Activations kept for the backward pass, per token per decoder layer, in bytes (q = n_h·d, kv = n_kv·d),
measured with saved-tensor hooks on the tiny shape (within 3% for fp32, bf16 autocast, full and LoRA):
    RMSNorm inputs (2 layer norms, per-head q/k norms): Qwen3's RMSNorm upcasts its input to fp32 and
      keeps that copy, whatever the compute dtype                                   4·(2h + q + kv)
    linear-layer inputs, for layers with a trained weight or a LoRA adapter: in fp32 compute one tensor
      per distinct input (2h + q + i); under autocast each adapted layer keeps its own cast copy (peft casts
      the input to the fp32 adapter, autocast casts it back: Σ in), and a full fine-tune's q/k/v and
      gate/up each cast the fp32 norm output (5h + q + i)                           × cb
    attention: rotated q, k and v repeated to every head (transformers' SDPA path repeats them when there
      is a padding mask), output: 4q; under autocast also the mask, cast per layer: T  × cb
    MLP: gate, SiLU(gate), up (their product is the down projection's input): 3i  × cb
    trained norm weights (full fine-tune): the normalised tensors, 2h in the residual stream's dtype
      (fp32 trainable weights: 4) and q + kv at cb
    LoRA: each adapter's A output, r per adapted layer                              × cb
    SDPA kernels keep no T×T score matrix. With activation checkpointing only each layer's input (h, in the
    residual stream's dtype) is kept, plus one layer's full set during recomputation. Times micro-batch ×
    sequence length × layers.
Logits. SFT (trl's fused LM head): tiles of at most 4096 tokens × 32768 vocabulary entries at cb, never the
whole (B, T, V) tensor (fused_head_bytes). PPO: the LM head runs on the response positions only, at cb; a
training step runs the policy (activations, logits, and the fp32 log-softmax and entropy temporaries while
`ppo.core.logprobs_and_entropy` runs: logit_temporaries, measured) and its backward before the value model, so
its peak is the larger of the two.
Generation (PPO rollout, no gradients) of F sequences of S = prompt + response tokens
    sampling: KV cache 2·L·n_kv·d·F·S at cb, one step's (F, V) logits with their fp32 temporaries (cb + 32 B
    each: the sampling loop's log-softmax, probabilities, entropy and float64 CDF of the draw; generate()'s fp32
    copy, the step kept until its token is drawn and its log-softmax, softmax and entropy product; no engine keeps
    the logits of earlier steps: ppo.sampling.StepStats), and with a LoRA policy the
    merged copy (W + B·A, in model.dtype) of each adapted weight that sampling runs on; scoring: the
    reference's (F, R, V) logits with the log-sum-exp temporaries (cb + 8), or, when the old log-probs are
    recomputed (`ppo.recompute_logprobs`), the log-softmax and entropy temporaries (logit_temporaries), and
    one layer's working set.

Sequence lengths: every batch is padded to its longest row, so a stage's peak follows the longest row it
meets. `rlhf doctor` tokenizes the training data with the model's tokenizer when both are on this machine
(`Lengths`); otherwise the plan takes the configured maxima (data.max_prompt_length, <stage>.max_length).

Runtime overhead (measured, see RUNTIME_OVERHEAD_MIB and ALLOCATOR_SLACK): on the CPU, the anonymous memory a
stage allocates besides tensors (library objects created on first use, tokenizer, data, thread pools) and
glibc's habit of keeping freed large blocks (peak RSS ≈ 2 × the transient tensors); on a GPU the CUDA context and
the caching allocator. The pages of mapped library files are left out: how many of them are resident depends on
the page cache (a freshly installed environment maps more of each file), not on the run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlhf_cli import quantization
from rlhf_cli.accel.limits import (
    CPU_MERGE_MAX_BYTES,
    ONEDNN_CACHE_BYTES,
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_MIN_DIM,
    enabled,
    onednn_by_default,
)
from rlhf_cli.choices import REWARD_MODEL
from rlhf_cli.precision import SHORT, precision
from rlhf_cli.tiny import is_tiny_spec

GiB = 2**30
MiB = 2**20
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Measured on a 2-core CPU box with the tiny recipe (torch 2.13, transformers 5.24, trl 1.16, peft 0.21,
# 1 thread) with bench/probes/rss_probe.py: peak RSS growth (after the stage's imports) minus the static tensors
# and the slack on the transient ones, fitted over runs of the recipe (sft and reward 5 steps, a full epoch, and
# micro-batch 1; ppo 8, 128 and 512 episodes; runs of one configuration differ by up to ±20 MiB) - what a run
# allocates that no term above counts: library code imported on first use, tokenizer, data and datasets, the
# trainer, thread pools. They follow the stages' code: re-measure when a stage changes what it allocates
# (tests/test_doctor.py's slow test compares every stage with its plan).
# GPUs: CUDA context and the caching allocator's reserve, an assumption (no GPU to measure here).
# dpo: taken as sft's (the same trainer machinery and fused LM head), not fitted.
RUNTIME_OVERHEAD_MIB = {"cpu": {"sft": 64, "reward": 26, "ppo": 32, "dpo": 64},
                        "cuda": {"sft": 768, "reward": 768, "ppo": 768, "dpo": 768}}
# Peak RSS / peak live transient tensors: glibc's malloc raises its mmap threshold after frees, so freed
# activation and logits buffers stay resident (measured 1.9-2.2 on the tiny PPO runs). PyTorch's CUDA caching
# allocator fragments far less.
ALLOCATOR_SLACK = {"cpu": 2.0, "cuda": 1.1}
# PPO on the stock code (the fast paths off, sharded, or on an accelerator): transformers' generate() allocates its
# code's objects and caches at the first call (~10 MiB anonymous memory on the CPU; bench/results/NOTES.md has the
# tiny and real-shape measurements this allowance is checked against).
STOCK_RUNTIME_MIB = 12


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
    "Qwen/Qwen3-14B": Arch(151936, 5120, 17408, 40, 40, 8, 128, False),
    "Qwen/Qwen3-32B": Arch(151936, 5120, 25600, 64, 64, 8, 128, False),
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
    if is_tiny_spec(name):
        t = model_cfg.tiny
        # the tokenizer trained on the demo data can come out a little smaller than vocab_size: an upper bound;
        # embedding_rows, when set, is the model's vocabulary (the logits have that many entries)
        rows = int(t.embedding_rows or t.vocab_size)
        return Arch(rows, int(t.hidden_size), int(t.intermediate_size), int(t.num_hidden_layers),
                    int(t.num_attention_heads), int(t.num_key_value_heads), int(t.head_dim), True), \
            "model.tiny (conf/model/tiny.yaml)"
    local = Path(name).expanduser() / "config.json"
    files = [local] if local.is_file() else _cached_config_files(name, model_cfg.cache_dir)
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


def cached_model_dirs(name: str, cache_dir: str | None = None) -> list[Path]:
    """Directories of a hub id's snapshots in the local caches (their config.json found; no network)."""
    return [f.parent for f in _cached_config_files(name, cache_dir)]


# --------------------------------------------------------------------------------------------- parameters
def linear_shapes(a: Arch) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer."""
    h, q, kv, i = a.hidden_size, a.q_dim, a.kv_dim, a.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def quantized_linears(a: Arch) -> tuple[int, int]:
    """(weights, output rows) of the decoder's linear layers: what bitsandbytes quantizes (not the embeddings,
    norms or output layers)."""
    shapes = linear_shapes(a).values()
    return a.num_hidden_layers * sum(i * o for i, o in shapes), a.num_hidden_layers * sum(o for _, o in shapes)


def backbone_params(a: Arch) -> int:
    per_layer = sum(i * o for i, o in linear_shapes(a).values()) + 2 * a.hidden_size
    if a.qk_norm:
        per_layer += 2 * a.head_dim
    return a.vocab_size * a.hidden_size + a.num_hidden_layers * per_layer + a.hidden_size


def causal_lm_params(a: Arch) -> int:
    return backbone_params(a) + (0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size)


def seq_cls_params(a: Arch) -> int:
    return backbone_params(a) + a.hidden_size  # score head, 1 output, no bias


def lora_targets(target_modules) -> tuple[str, ...]:
    """The module names a LoRA `target_modules` value adapts ("all-linear": every decoder linear layer)."""
    if str(target_modules) == "all-linear":
        return LORA_TARGETS
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    return tuple(str(t) for t in names)


def lora_params(a: Arch, r: int, target_modules) -> int:
    targets = lora_targets(target_modules)
    shapes = linear_shapes(a)
    per_layer = sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)
    head = r * (a.hidden_size + a.vocab_size) if "lm_head" in targets else 0  # the output layer, once
    return a.num_hidden_layers * per_layer + head


def adapted_weight_params(a: Arch, target_modules) -> int:
    """Parameters of the weights a LoRA adapts (what merging W + B·A copies)."""
    targets = lora_targets(target_modules)
    shapes = linear_shapes(a)
    n = a.num_hidden_layers * sum(shapes[t][0] * shapes[t][1] for t in targets if t in shapes)
    return n + (a.hidden_size * a.vocab_size if "lm_head" in targets else 0)


def activation_bytes_per_token_layer(a: Arch, cb: int, *, trainable: bool, lora: tuple[str, ...] = (),
                                     r: int = 0, cast: bool | None = None, residual_bytes: int = 4,
                                     seq: int = 0) -> float:
    """Bytes one decoder layer keeps for the backward pass per token (see the module docstring).

    cb: compute dtype bytes; trainable: the layer's own weights train (full fine-tune), else they are frozen
    and `lora` names the adapted layers (rank r); cast: layers cast their inputs (autocast over fp32 weights
    or adapters; default: cb < 4); residual_bytes: dtype of the residual stream; seq: sequence length (the
    padding mask that autocast casts per layer)."""
    h, q, kv, i = a.hidden_size, a.q_dim, a.kv_dim, a.intermediate_size
    cast = cb < 4 if cast is None else cast
    shapes = linear_shapes(a)
    adapted = () if trainable else tuple(t for t in lora if t in shapes)
    norm_inputs = 4 * (2 * h + (q + kv if a.qk_norm else 0))
    extra = 0.0
    if trainable:
        inputs = (5 * h if cast else 2 * h) + q + i
        extra = residual_bytes * 2 * h + cb * (q + kv if a.qk_norm else 0)
    elif cast:
        inputs = sum(shapes[t][0] for t in adapted)
    else:
        # one tensor feeds q/k/v, another gate/up
        groups = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
        inputs = sum(shapes[t][0] for t in {groups.get(t, t): t for t in adapted}.values())
    per = cb * (inputs + 4 * q + 3 * i + r * len(adapted) + (seq if cast else 0))
    return norm_inputs + extra + per


def _activations(a: Arch, batch: int, seq: int, cb: int, checkpointing: bool = False, **kw) -> float:
    """Activations of a micro-batch of `batch` sequences of `seq` tokens (kw: see
    activation_bytes_per_token_layer)."""
    per = activation_bytes_per_token_layer(a, cb, seq=seq, **kw)
    if checkpointing:
        return batch * seq * (a.num_hidden_layers * a.hidden_size * kw.get("residual_bytes", 4) + per)
    return batch * seq * a.num_hidden_layers * per


def logit_temporaries(cb: int) -> int:
    """Bytes per logit that `ppo.core.logprobs_and_entropy` adds to the logits while it runs (measured):
    fp32 compute keeps the temperature-scaled copy, the log-softmax, exp and their product (16); 16-bit
    compute an fp32 upcast, the softmax and the product (the log-sum-exp goes row by row) (12)."""
    return 16 if cb >= 4 else 12


# trl's fused LM head (SFTTrainer, trl.kernels.chunked_logprob): logits in tiles of at most this many tokens ×
# vocabulary entries, never the whole (tokens, V) tensor
FUSED_TILE = (4096, 32768)


def fused_head_bytes(a: Arch, tokens: int, cb: int, accelerator: str, training: bool,
                     head_trainable: bool) -> float:
    """Peak bytes of trl's fused LM head over `tokens` positions: one compute-dtype tile; on the CPU (its
    torch fallback) the tile's fp32 temporaries too, measured in the tiny recipe's SFT runs at 10 B per tile
    element in an evaluation and 20 B in a training step; on a GPU a Triton kernel folds the tile in place. A
    training step adds the fp32 gradient accumulators of the hidden states and, when the LM head trains, of its
    weight."""
    tile = min(tokens, FUSED_TILE[0]) * min(a.vocab_size, FUSED_TILE[1])
    per = cb if accelerator == "cuda" else cb + (20 if training else 10)
    grads = 4 * a.hidden_size * (tokens + (a.vocab_size if head_trainable else 0)) if training else 0
    return tile * per + grads


def layer_working_bytes(a: Arch, cb: int) -> float:
    """Bytes per token of one decoder layer in a forward without gradients (evaluation, PPO scoring): the
    residual and the fp32 normalised input (h·(cb + 4)), and the larger of attention (q, repeated k and v,
    output: 4q) and the MLP (gate, up, their product: 3i)."""
    h, q, i = a.hidden_size, a.q_dim, a.intermediate_size
    return h * (cb + 4) + cb * max(4 * q, 3 * i)


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
    def peak(self) -> float:
        """Peak memory of one process: tensors, allocator slack on the transient part, runtime overhead."""
        return self.static + self.slack * self.transient + self.overhead


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
    """What the plan depends on besides the architecture (read from the composed config by `setup_from`)."""
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


def setup_from(cfg, visible_gpus: int = 0, lengths: Lengths | None = None) -> Setup:
    """`device.num_processes=auto` plans for the visible GPUs (8 when none is visible here)."""
    d = cfg.device
    # planned for the device the recipe names, whatever this machine has: a GPU with bf16 (fp16 is the same size)
    p = precision(cfg.model.dtype, d.mixed_precision, str(d.accelerator),
                  cuda_bf16=True if str(d.accelerator) == "cuda" else None)
    n = d.num_processes
    per_machine = (visible_gpus or 8) if str(n) == "auto" else int(n)
    strategy = str(d.strategy)
    zero = int(d.zero_stage) if strategy == "deepspeed" else 0
    return Setup(accelerator=str(d.accelerator), strategy=strategy, world=per_machine * int(d.num_machines),
                 per_machine=per_machine, zero_stage=zero, offload_optimizer=bool(d.offload_optimizer),
                 offload_params=bool(d.offload_params), frozen_bytes=DTYPE_BYTES[p.storage],
                 compute_bytes=DTYPE_BYTES[p.compute], dtype_name=p.storage, compute_name=SHORT[p.compute],
                 lengths=lengths or Lengths(), quantization=quantization.mode(cfg.model))


def prompt_tokens(cfg, s: Setup) -> tuple[int, str]:
    """(prompt length the plan uses, what it is): the data's longest prompt, else data.max_prompt_length
    (longer prompts are dropped by the stages, so it caps the data's figure too)."""
    cap = int(cfg.data.max_prompt_length)
    if s.lengths.prompt is None:
        return cap, f"data.max_prompt_length={cap}"
    return min(s.lengths.prompt, cap), f"the data's longest prompt; data.max_prompt_length={cap} caps it"


def sequence_tokens(cfg, stage: str, s: Setup) -> tuple[int, str]:
    """(sequence length the plan uses for sft / reward / dpo, what it is): the data's longest row cut at
    <stage>.max_length, else <stage>.max_length."""
    cap = int(cfg[stage].max_length)
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


def _trainable(plan: StagePlan, s: Setup, name: str, params: float, label: str) -> float:
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


def _frozen(plan: StagePlan, s: Setup, name: str, params: float, sharded: bool = False,
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


def _casts(s: Setup) -> bool:
    """Whether layers cast their inputs under autocast (DeepSpeed runs the whole module in the compute
    dtype)."""
    return s.compute_bytes < 4 and s.strategy != "deepspeed"


def plan_sft(cfg, a: Arch, s: Setup) -> StagePlan:
    st = cfg.sft
    plan = StagePlan("sft")
    cb = s.compute_bytes
    p = causal_lm_params(a)
    if bool(st.lora.enabled):
        _frozen(plan, s, "policy base", p, sharded=True, a=a)
        targets, r = lora_targets(st.lora.target_modules), int(st.lora.r)
        copies = _trainable(plan, s, "LoRA adapter", lora_params(a, r, targets), "LoRA")
        kw = {"trainable": False, "lora": targets, "r": r, "residual_bytes": s.frozen_bytes}
    else:
        copies = _trainable(plan, s, "policy weights", p, "policy")
        kw = {"trainable": True, "residual_bytes": cb if s.strategy == "deepspeed" else 4}
    b = int(st.per_device_train_batch_size)
    t, t_note = sequence_tokens(cfg, "sft", s)
    plan.notes.append(f"sequence length {t} tokens: {t_note}")
    ckpt = bool(st.activation_checkpointing)
    act = _activations(a, b, t, cb, ckpt, cast=_casts(s), **kw)
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


def plan_reward(cfg, a: Arch, s: Setup) -> StagePlan:
    st = cfg.reward
    plan = StagePlan("reward")
    cb = s.compute_bytes
    copies = _trainable(plan, s, "reward model weights", seq_cls_params(a), "reward model")
    kw = {"trainable": True, "residual_bytes": cb if s.strategy == "deepspeed" else 4, "cast": _casts(s)}
    b, be = 2 * int(st.per_device_train_batch_size), 2 * int(st.per_device_eval_batch_size)
    t, t_note = sequence_tokens(cfg, "reward", s)
    plan.notes.append(f"sequence length {t} tokens: {t_note}")
    ckpt = bool(st.activation_checkpointing)
    act = _activations(a, b, t, cb, ckpt, **kw)
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


def recomputes_logprobs(cfg, s: Setup) -> bool:
    """ppo.recompute_logprobs: auto recomputes the old log-probs when compute is not fp32."""
    v = str(cfg.ppo.recompute_logprobs).lower()
    return v == "true" or (v == "auto" and s.compute_bytes < 4)


def _ppo_weights(plan: StagePlan, p, a: Arch, ps: Setup) -> float:
    """The models of a PPO run (policy + reference, value model for gae, reward model when `ppo.reward` uses
    it), their gradients and optimizer states; returns the bytes of the autocast copies of what trains."""
    pl, pc = causal_lm_params(a), seq_cls_params(a)
    targets, r = lora_targets(p.lora.target_modules), int(p.lora.r)
    value_targets = tuple(t for t in targets if t != "lm_head")  # a value model has no LM head
    copies = 0.0
    if bool(p.lora.enabled):
        _frozen(plan, ps, "policy base", pl, sharded=True, a=a)
        plan.items.append(Item("reference", 0, "the policy base with its adapter disabled"))
        n_policy = lora_params(a, r, targets)
        copies += _trainable(plan, ps, "LoRA adapter", n_policy, "LoRA")
    else:
        n_policy = pl
        copies += _trainable(plan, ps, "policy weights", pl, "policy")
        _frozen(plan, ps, "reference weights", pl, sharded=True)
    n_value = 0
    if str(p.advantage) != "gae":
        plan.items.append(Item("value model", 0, f"none: ppo.advantage={p.advantage} needs no critic"))
    elif bool(p.value_lora):
        _frozen(plan, ps, "value trunk", pc, sharded=True, a=a)
        n_value = lora_params(a, r, value_targets) + a.hidden_size
        copies += _trainable(plan, ps, "value LoRA + score head", n_value, "value LoRA")
    elif bool(p.sparse_value_embedding) and ps.world == 1 and not float(p.weight_decay):
        # the embedding steps through the rows tokens reach (rlhf_cli/accel/sparse_rows.py): no dense gradient; its
        # moments grow with the distinct tokens seen, planned here for every row (a long run's upper bound)
        n_value, emb = pc, a.vocab_size * a.hidden_size
        copies += _trainable(plan, ps, "value model weights (less the embedding)", pc - emb, "value model")
        plan.items.append(Item("value embedding", emb * 4, f"{emb / 1e6:.2f}M × 4 B (fp32, stepped by rows)"))
        plan.items.append(Item("optimizer (value embedding rows)", emb * 8,
                               "AdamW moments of the rows seen, 8 B/param; at most every row"))
    else:
        n_value = pc
        copies += _trainable(plan, ps, "value model weights", pc, "value model")
    sources = p.reward
    if REWARD_MODEL in ([sources] if isinstance(sources, str) else list(sources)):
        _frozen(plan, ps, "reward model weights", pc, sharded=True, a=a)
    # what a checkpoint holds: the trainable weights (fp32) and their AdamW states, plus counters and RNG
    plan.checkpoint = (n_policy + n_value) * (4 + 8)
    return copies


def _onednn_caches(cfg, a: Arch, s: Setup) -> bool:
    """Whether PPO's linear layers run on oneDNN here (rlhf_cli.accel.cpu_linear): on the CPU, device.fast_paths
    not off, device.cpu_matmul onednn (or auto on a CPU onednn_by_default names), fp32 weights and compute, layers
    at least ONEDNN_MIN_DIM wide."""
    d = cfg.device
    matmul = str(d.cpu_matmul)
    return (s.accelerator == "cpu" and str(d.fast_paths) != "off" and not s.quantization
            and (matmul == "onednn" or (matmul == "auto" and onednn_by_default()))
            and s.compute_name == "fp32" and s.frozen_bytes == 4 and a.hidden_size >= ONEDNN_MIN_DIM)


def _sharded_units(plan: StagePlan, a: Arch, ps: Setup, params: float, what: str) -> float:
    """Under FSDP, the weights a forward holds gathered besides its shards: the decoder layer running and the
    next one (prefetched), and one vocabulary matrix (the embedding, or an untied output layer: units of their
    own, rlhf_cli.ppo.shard), all in model.dtype; 0 unsharded."""
    if ps.strategy != "fsdp" or ps.world <= 1:
        return 0.0
    matrix = a.vocab_size * a.hidden_size
    layer = (params - matrix * (1 if a.tie_word_embeddings else 2)) / a.num_hidden_layers
    nbytes = (2 * layer + matrix) * ps.frozen_bytes
    plan.items.append(Item(f"gathered units ({what})", nbytes, f"2 decoder layers + a vocabulary matrix × "
                           f"{ps.frozen_bytes} B, all-gathered for one forward", "transient"))
    return nbytes


def _ppo_sampling(plan: StagePlan, cfg, a: Arch, ps: Setup, f: int, prompt: int, seq: int, adapted: tuple | None,
                  copies: float = 0.0) -> None:
    """Rollout, step 1: sampling `f` sequences of `seq` tokens (`prompt` of them the prompt's) with a KV cache
    (adapted: the LoRA policy's adapted layers, None without LoRA; copies: the policy's trainable weights cast to
    the compute dtype, which autocast keeps for the rollout). Sharded, the policy is gathered whole for the phase
    (`device.fsdp.gather_for_sampling`, rlhf_cli.ppo.shard.gathered) or layer by layer at every token."""
    cb, wb, V, L = ps.compute_bytes, ps.frozen_bytes, a.vocab_size, a.num_hidden_layers
    kv = 2 * L * a.kv_dim * f * seq * cb
    step_logits = f * V * (cb + 32)
    prefill = f * prompt * layer_working_bytes(a, cb)
    plan.items.append(Item("KV cache", kv, f"2·{L} layers·{a.kv_dim}·{f} seqs·{seq} tokens × {cb} B",
                           "transient"))
    plan.items.append(Item("sampling step logits", step_logits, f"{f}·{V} × ({cb} + 32) B: one step's "
                           "logits and their fp32 log-prob / entropy temporaries (no engine keeps earlier steps')",
                           "transient"))
    plan.items.append(Item("prompt forward (one layer)", prefill, f"{f}·{prompt} prompt tokens through one decoder "
                           "layer at a time", "transient"))
    if copies:
        plan.items.append(Item("autocast copies (sampling)", copies, f"the policy's trainable weights × {cb} B, "
                               "kept by autocast for the rollout", "transient"))
    merged = gathered = 0.0
    sharded = ps.strategy == "fsdp" and ps.world > 1
    if sharded and gathers_for_sampling(cfg):
        gathered = causal_lm_params(a) * wb
        plan.items.append(Item("gathered policy", gathered, f"the whole policy × {wb} B, all-gathered once for "
                               "the phase (device.fsdp.gather_for_sampling)", "transient"))
    elif sharded:
        gathered = _sharded_units(plan, a, ps, causal_lm_params(a), "policy, every token")
    elif adapted is not None and fast_paths_on(cfg, ps):
        # the fast sampling loop (rlhf_cli.accel) samples on the LoRA merged into a copy of each adapted weight,
        # except on a CPU with adapted weights over CPU_MERGE_MAX_BYTES; stock generate() runs unmerged
        merged = adapted_weight_params(a, adapted) * wb
        if ps.accelerator == "cpu" and merged > CPU_MERGE_MAX_BYTES:
            merged = 0.0
        else:
            plan.items.append(Item("merged LoRA weights", merged,
                                   f"W + B·A copies of the adapted weights × {wb} B", "transient"))
    plan.phases["sampling"] = kv + step_logits + prefill + copies + merged + gathered


def _policy_copies(p, a: Arch, ps: Setup) -> float:
    """Bytes of the policy's trainable weights cast to the compute dtype under autocast (0 where nothing casts)."""
    if not _casts(ps):
        return 0.0
    n = lora_params(a, int(p.lora.r), lora_targets(p.lora.target_modules)) if bool(p.lora.enabled) \
        else causal_lm_params(a)
    return n * ps.compute_bytes


def gathers_for_sampling(cfg) -> bool:
    fsdp = cfg.device.get("fsdp") or {}
    return bool(fsdp.get("gather_for_sampling", True))


def fast_paths_on(cfg, s: Setup) -> bool:
    """Whether rlhf_cli.accel's speed paths run (device.fast_paths on this accelerator; never sharded)."""
    sharded = s.strategy == "fsdp" and s.world > 1
    checkpointed = bool(cfg.ppo.get("activation_checkpointing", False))  # rlhf_cli.accel.configure turns them off
    return not (sharded or checkpointed or s.quantization) and enabled(str(cfg.device.get("fast_paths") or "auto"), s.accelerator)


def _ppo_scoring(plan: StagePlan, cfg, a: Arch, ps: Setup, f: int, seq: int, resp: int) -> None:
    """Rollout, step 2: scoring (reference / recomputed log-probs, values, reward), no gradients."""
    cb, V = ps.compute_bytes, a.vocab_size
    recompute = recomputes_logprobs(cfg, ps)
    frv = f * resp * V
    extra = logit_temporaries(cb) if recompute else 8
    one_layer = f * seq * layer_working_bytes(a, cb)
    scored = "recomputed log-probs with their entropy" if recompute else "reference log-probs"
    if recompute and cb < 4:
        # low-precision logits: log-probs and entropy are taken one row at a time (ppo.core), so the float32
        # temporaries cover one (R, V) row, not the chunk
        score = frv * cb + resp * V * extra
        what = f"{f}·{resp}·{V} × {cb} B + one row's {resp}·{V} × {extra} B: {scored}"
    else:
        score = frv * (cb + extra)
        what = f"{f}·{resp}·{V} × ({cb} + {extra}) B: {scored}"
    plan.items.append(Item("scoring logits", score, what + "; or one layer's working set, the larger", "transient"))
    # a scoring forward peaks inside a decoder layer or at the head: the logits exist once every layer is done
    plan.phases["scoring"] = max(score, one_layer) + _sharded_units(plan, a, ps, causal_lm_params(a), "scoring")


def _ppo_training(plan: StagePlan, p, a: Arch, ps: Setup, seq: int, copies: float) -> None:
    """Step 5, a training micro-batch: the policy's forward, log-softmax and backward, then the value model's
    (PPOTrainer.micro_batch_step): the two sets of activations are never alive together."""
    cb, wb, V, L = ps.compute_bytes, ps.frozen_bytes, a.vocab_size, a.num_hidden_layers
    b, resp = int(p.per_device_train_batch_size), int(p.response_length)
    targets, r = lora_targets(p.lora.target_modules), int(p.lora.r)
    value_targets = tuple(t for t in targets if t != "lm_head")  # a value model has no LM head
    lora, value_lora, cast = bool(p.lora.enabled), bool(p.value_lora), _casts(ps)
    ck = bool(p.get("activation_checkpointing", False))
    held = f"micro-batch {b} × {seq} tokens × {L} layers" + (", checkpointed: each layer's input, one layer's "
                                                              "activations" if ck else "")
    act_p = _activations(a, b, seq, cb, checkpointing=ck, trainable=not lora, lora=targets if lora else (), r=r,
                         cast=cast, residual_bytes=wb if lora else 4)
    plan.items.append(Item("policy activations", act_p, held, "transient"))
    act_v = 0.0
    if str(p.advantage) == "gae":
        act_v = _activations(a, b, seq, cb, checkpointing=ck, trainable=not value_lora,
                             lora=value_targets if value_lora else (), r=r, cast=cast,
                             residual_bytes=wb if value_lora else 4)
        plan.items.append(Item("value activations", act_v, held, "transient"))
    per_logit = cb + logit_temporaries(cb)
    logits = b * resp * V * per_logit
    plan.items.append(Item("policy logits", logits, f"{b}·{resp}·{V} × ({cb} + {per_logit - cb}) B: logits, "
                           "fp32 log-softmax and entropy temporaries", "transient"))
    if copies:
        plan.items.append(Item("autocast weight copies", copies, f"trainable weights × {cb} B for a step",
                               "transient"))
    units = _sharded_units(plan, a, ps, causal_lm_params(a), "training")
    plan.phases["training step"] = copies + max(act_p + logits, act_v) + units


def ppo_setup(s: Setup) -> Setup:
    """The setup PPO runs under: FSDP2 shards (several processes, device.strategy=fsdp, nothing offloaded), else
    whole models (one process, or DDP replicas: DeepSpeed is planned as the ddp run it would be)."""
    sharded = s.strategy == "fsdp" and s.world > 1
    return replace(s, strategy="fsdp" if sharded else "ddp" if s.world > 1 else "single", zero_stage=0,
                   offload_optimizer=False, offload_params=False)


def plan_ppo(cfg, a: Arch, s: Setup) -> StagePlan:
    p = cfg.ppo
    plan = StagePlan("ppo")
    ps = ppo_setup(s)
    copies = _ppo_weights(plan, p, a, ps)
    if _onednn_caches(cfg, a, ps):
        plan.items.append(Item("oneDNN primitive caches", ONEDNN_CACHE_BYTES,
                               f"{ONEDNN_CACHE_CAPACITY} compiled products × 2 caches (device.cpu_matmul)"))
    if not fast_paths_on(cfg, ps):
        plan.items.append(Item("stock code runtime", STOCK_RUNTIME_MIB * MiB, "generate()'s code and caches, "
                               "allocated at its first call, and the stock forwards' resident free blocks"))
    b, resp = int(p.per_device_train_batch_size), int(p.response_length)
    prompt, prompt_note = prompt_tokens(cfg, s)
    seq = prompt + resp
    plan.notes.append(f"sequence length {seq} tokens: prompt {prompt} ({prompt_note}) + response {resp} "
                      "(ppo.response_length)")
    local_batch = b * int(p.gradient_accumulation_steps) * int(p.num_mini_batches)
    f = min(int(p.rollout_forward_batch_size), local_batch)
    buffer = local_batch * (seq * 8 * 3 + resp * (8 + 4 * 6))
    plan.items.append(Item("rollout buffer", buffer, f"{local_batch} episodes × {seq} tokens (ids, masks, "
                           "log-probs, values, rewards)"))
    adapted = lora_targets(p.lora.target_modules) if bool(p.lora.enabled) else None
    _ppo_sampling(plan, cfg, a, ps, f, prompt, seq, adapted, _policy_copies(p, a, ps))
    _ppo_scoring(plan, cfg, a, ps, f, seq, resp)
    _ppo_training(plan, p, a, ps, seq, copies)
    if int(p.get("eval_every", 0) or 0) > 0:
        _ppo_evaluation(plan, cfg, a, ps, prompt, adapted)
    return plan


def _ppo_evaluation(plan: StagePlan, cfg, a: Arch, ps: Setup, prompt: int, adapted: tuple | None) -> None:
    """ppo.eval_every: held-out prompts sampled and scored in chunks of eval.batch_size (rlhf_cli.ppo.evaluation),
    each process taking its share of eval.num_prompts; the same two steps as a rollout at that chunk size."""
    e = cfg.eval
    f = max(1, min(int(e.batch_size), -(-int(e.num_prompts) // max(ps.world, 1))))
    resp = int(e.response_length)
    sub = StagePlan("ppo")
    _ppo_sampling(sub, cfg, a, ps, f, prompt, prompt + resp, adapted, _policy_copies(cfg.ppo, a, ps))
    _ppo_scoring(sub, cfg, a, ps, f, prompt + resp, resp)
    total = max(sub.phases.values())
    plan.items.append(Item("evaluation (ppo.eval_every)", total, f"sampling and scoring {f} held-out prompts at a "
                           f"time (eval.batch_size) × {prompt + resp} tokens", "transient"))
    plan.phases["evaluation"] = total


def plan_dpo(cfg, a: Arch, s: Setup) -> StagePlan:
    """trl's DPOTrainer: each step runs the policy on chosen + rejected (2 × micro-batch sequences) with
    gradients, then, while those activations are held, the reference on the same sequences without them (with
    LoRA the policy with its adapter disabled, else a frozen copy in model.dtype), both through trl's fused LM
    head; then the backward."""
    st = cfg.dpo
    plan = StagePlan("dpo")
    cb = s.compute_bytes
    p = causal_lm_params(a)
    lora = bool(st.lora.enabled)
    if lora:
        _frozen(plan, s, "policy base", p, sharded=True, a=a)
        plan.items.append(Item("reference", 0, "the policy base with its adapter disabled"))
        targets, r = lora_targets(st.lora.target_modules), int(st.lora.r)
        copies = _trainable(plan, s, "LoRA adapter", lora_params(a, r, targets), "LoRA")
        kw = {"trainable": False, "lora": targets, "r": r, "residual_bytes": s.frozen_bytes}
        plan.checkpoint = lora_params(a, r, targets) * (4 + 8)
    else:
        copies = _trainable(plan, s, "policy weights", p, "policy")
        _frozen(plan, s, "reference weights", p, sharded=True)
        kw = {"trainable": True, "residual_bytes": cb if s.strategy == "deepspeed" else 4}
        plan.checkpoint = p * (4 + 8)
    b, be = 2 * int(st.per_device_train_batch_size), 2 * int(st.per_device_eval_batch_size)
    t, t_note = sequence_tokens(cfg, "dpo", s)
    plan.notes.append(f"sequence length {t} tokens: {t_note}")
    ckpt = bool(st.activation_checkpointing)
    act = _activations(a, b, t, cb, ckpt, cast=_casts(s), **kw)
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
PLANNERS = {"sft": plan_sft, "reward": plan_reward, "ppo": plan_ppo, "dpo": plan_dpo}  # each training stage (test)


def plan_stage(cfg, stage: str, a: Arch, s: Setup | None = None) -> StagePlan:
    s = s or setup_from(cfg)
    plan = PLANNERS[stage](cfg, a, s)
    kind = "cuda" if s.accelerator == "cuda" else "cpu"
    plan.overhead = RUNTIME_OVERHEAD_MIB[kind][stage] * MiB
    plan.slack = ALLOCATOR_SLACK[kind]
    key = quantization.LORA_KEYS.get(stage)
    if s.quantization and key and not bool(cfg[stage].lora.enabled):
        plan.notes.append(f"planned unquantized: {stage} refuses model.quantization={s.quantization} with "
                          f"{key}=false (set it true for QLoRA)")
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
    if stage in ("sft", "reward", "dpo"):
        if not bool(st.activation_checkpointing):
            out.append(({f"{stage}.activation_checkpointing": True}, {}))
        if s.accelerator == "cuda":
            n = max(s.per_machine, 2)
            many = {"world": n * max(s.world // max(s.per_machine, 1), 1), "per_machine": n}
            for kw in ({"strategy": "deepspeed", "zero_stage": 2}, {"strategy": "deepspeed", "zero_stage": 3},
                       {"strategy": "fsdp", "zero_stage": 0}):
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
        if not bool(st.get("activation_checkpointing", False)):
            out.append(({"ppo.activation_checkpointing": True}, {}))
        sharded = s.strategy == "fsdp" and s.world > 1
        if sharded and gathers_for_sampling(cfg):
            out.append(({"device.fsdp.gather_for_sampling": False}, {}))
        if s.accelerator == "cuda" and not sharded:
            n = max(s.per_machine, 8)
            out.append(({}, {"strategy": "fsdp", "zero_stage": 0, "per_machine": n,
                             "world": n * max(s.world // max(s.per_machine, 1), 1)}))
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
    lines += [f"    {note}" for note in plan.notes]
    for it in plan.items:
        tag = {"transient": " (peak of a phase)", "offloaded": " (CPU memory)"}.get(it.kind, "")
        lines.append(f"    {it.name:<28}{fmt_bytes(it.bytes):>12}  {it.note}{tag}")
    phase = max(plan.phases, key=plan.phases.get) if plan.phases else "-"
    if len(plan.phases) > 1:
        lines.append(f"    {'phases':<28}{'':>12}  "
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.phases.items()))
    lines.append(f"    {'tensors at peak':<28}{fmt_bytes(plan.tensors):>12}  static "
                 f"{fmt_bytes(plan.static)} + {phase} {fmt_bytes(plan.transient)}")
    lines.append(f"    {'runtime overhead':<28}{fmt_bytes(plan.peak - plan.tensors):>12}  "
                 f"{fmt_bytes(plan.overhead)} runtime constant + allocator slack ×{plan.slack:g} on the "
                 "transient part")
    lines.append(f"    {'peak per process':<28}{fmt_bytes(plan.peak):>12}")
    if plan.checkpoint:
        lines.append(f"    {'checkpoint on disk':<28}{fmt_bytes(plan.checkpoint):>12}  what trains (fp32) "
                     "and its AdamW states, counters, RNG")
    return lines
