"""One-token decoding steps of a Llama-style decoder (Qwen3, Qwen2, Llama) without the model's per-call machinery.

After the prefill, each sampling step feeds one token per row through the model. For the sizes rlhf is run at on
a CPU, the step's matrix products are under half its time (bench's mid workload at 32 rows): the rest is the
per-module Python of the stock forward (keyword plumbing, output records, the mask built again every step) and its
small tensor operations. `Decoder` runs the same layers in the same order, calling the model's own norms, rotary
embedding, activation and embedding modules, its cache, and the attention kernel with the inputs the stock sdpa
path gives it (grouped queries packed per key/value head), so the logits are the stock forward's.

Only plain weights are read: a model with hooks (accelerate offload, DeepSpeed ZeRO-3), sharded or wrapped
parameters, an active unmerged adapter, sliding-window layers, an attention other than sdpa or another architecture
gets `None` from `Decoder.of` and is stepped through its stock forward.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

MODEL_TYPES = ("qwen3", "qwen2", "llama")


def _plain_weight(module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a linear layer whose output is exactly F.linear(x, weight, bias): an `nn.Linear`, or a
    PEFT LoRA layer with its adapter disabled or merged into the base weight. None for anything else."""
    if type(module) is not nn.Linear:
        base = getattr(module, "base_layer", None)
        if type(base) is not nn.Linear or not (getattr(module, "disable_adapters", False) or
                                               getattr(module, "merged", False)):
            return None
        module = base
    w = module.weight
    if type(w) not in (torch.Tensor, nn.Parameter) or w.dim() != 2 or w.is_meta:
        return None
    return w, module.bias


def hooked(model: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules())


class _Layer:
    def __init__(self, layer, config, head_dim: int) -> None:
        """`config`: the model's transformers config (its head counts)."""
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.act = mlp.act_fn
        self.rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.scaling = attn.scaling
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim
        lins = [_plain_weight(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                           mlp.up_proj, mlp.down_proj)]
        self.ok = all(x is not None for x in lins)
        if self.ok:
            self.q, self.k, self.v, self.o, self.gate, self.up, self.down = lins


class Decoder:
    """`Decoder.of(model, cache)(ids, mask, positions)`: the logits (B, V) of one new token per row.

    ids (B,) the tokens; mask (B, L) the attention mask over the cache and the new token; positions (B, 1).
    `linear(x, weight, bias)` computes every projection (the sampling loop passes its W·xᵀ rule)."""

    def __init__(self, lm, cache, layers: list[_Layer], head, linear) -> None:
        self.backbone, self.cache, self.layers, self.head, self.linear = lm.model, cache, layers, head, linear

    @classmethod
    def of(cls, model, cache, linear=None) -> Decoder | None:
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(lm, "config", None)
        backbone = getattr(lm, "model", None)
        if config is None or getattr(config, "model_type", None) not in MODEL_TYPES or backbone is None:
            return None
        if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
            return None
        # the steps call sdpa: a model whose prefill runs another kernel (eager, flash attention) keeps its own
        # forward for the steps too, so that prefill and steps compute attention the same way
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return None
        if hooked(lm) or not hasattr(backbone, "rotary_emb") or not hasattr(backbone, "embed_tokens"):
            return None
        head = _plain_weight(getattr(lm, "lm_head", None))
        if head is None:
            return None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        try:
            layers = [_Layer(layer, config, head_dim) for layer in backbone.layers[: config.num_hidden_layers]]
        except AttributeError:  # a layer of another shape
            return None
        if not all(x.ok for x in layers):
            return None
        return cls(lm, cache, layers, head, linear or (lambda x, w, b: F.linear(x, w, b)))

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        B = ids.shape[0]
        h = self.backbone.embed_tokens(ids[:, None])  # (B, 1, d)
        cos, sin = self.backbone.rotary_emb(h, positions)
        attend = mask.bool()[:, None, None, :]  # (B, 1, 1, L): the stock sdpa mask for one query
        for i, L in enumerate(self.layers):
            x = L.in_norm(h).view(B, -1)
            q = lin(x, *L.q).view(B, 1, L.heads, L.head_dim)
            k = lin(x, *L.k).view(B, 1, L.kv_heads, L.head_dim)
            v = lin(x, *L.v).view(B, 1, L.kv_heads, L.head_dim).transpose(1, 2)
            if L.q_norm is not None:
                q, k = L.q_norm(q), L.k_norm(k)
            q, k = L.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            k, v = self.cache.update(k, v, i)
            # one query per row: (B, heads, 1, D) -> (B, kv heads, heads per kv head, D), as the stock path packs it
            q = q.reshape(B, L.kv_heads, L.heads // L.kv_heads, L.head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=L.scaling)
            h = h + lin(o.reshape(B, -1), *L.o).view(B, 1, -1)
            x = L.post_norm(h).view(B, -1)
            h = h + lin(L.act(lin(x, *L.gate)) * lin(x, *L.up), *L.down).view(B, 1, -1)
        h = self.backbone.norm(h)
        return lin(h.view(B, -1), *self.head)
