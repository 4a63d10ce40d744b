"""A decoder's shape (`Arch`: from its config.json, the hub cache or a built-in table) and what it counts: parameters,
LoRA parameters, activation and logits bytes per token (the terms rlhf_cli.memory's docstring derives)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rlhf_cli.tiny import is_tiny_spec

GiB = 2**30
MiB = 2**20
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def activations(a: Arch, batch: int, seq: int, cb: int, checkpointing: bool = False, **kw) -> float:
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
