"""The last decoder layer over the positions whose outputs are read, not over the whole sequence.

Scoring and the PPO epochs read a decoder's outputs at a trailing block of positions only: the policy's logits
and the value model's values at P-1 … P+R-2 (the states that emit the R response tokens), the reward model's
score at each row's last response token. In a causal decoder the last layer's output at position t feeds
nothing but the final norm and head at t, so that layer's query projection, attention, output projection and
MLP are needed only at the read positions; its keys and values still cover every position (the read queries
attend to all of them). The saving grows with the share of the sequence that is prompt (bench/results/ has the
measured gain on bench's mid workload).

    install(model)                              # once: the model's last decoder layer learns to run on a span
    with span(start, end):                      # the next forwards' last layer runs on positions [start, end)
        h = backbone(...).last_hidden_state     # (B, end - start, d)

`install` switches the last layer of a Llama-style decoder (Qwen3, Qwen2, Llama: full attention, sdpa or eager
attention) and nothing else; `layer_of(model)` finds a switched layer through DDP, PEFT and rlhf's
`TokenValueModel` wrappers, so a caller knows before the call whether its output will be the span or the whole
sequence. Without a span set the layer runs its own forward. With one, an input the rewritten layer does not
handle (a cache, a mask of another kind) runs the layer's own forward and the span is sliced from its output,
so the output is the span either way. The span's outputs equal the whole sequence's at those positions (the
same modules on the same rows; tests compare logits, values, scores and gradients).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import torch
from torch import nn

from rlhf_cli.accel.decode import MODEL_TYPES, hooked

_SPAN: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("rlhf_tail_span", default=None)
_ATTENTION = ("sdpa", "eager")


@contextlib.contextmanager
def span(start: int, end: int):
    """The last layer of every switched model runs on positions [start, end) inside this block."""
    token = _SPAN.set((int(start), int(end)))
    try:
        yield
    finally:
        _SPAN.reset(token)


def _backbone_layer(backbone) -> nn.Module | None:
    cfg = getattr(backbone, "config", None)
    layers = getattr(backbone, "layers", None)
    if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return None
    if not isinstance(layers, nn.ModuleList):
        return None
    if not hasattr(backbone, "rotary_emb") or not hasattr(backbone, "norm"):
        return None
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return None
    n = int(getattr(cfg, "num_hidden_layers", len(layers)))
    return layers[n - 1] if 0 < n <= len(layers) else None


def _shaped(layer) -> bool:
    attn = getattr(layer, "self_attn", None)
    parts = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
    if attn is None or not all(hasattr(attn, p) for p in parts):
        return False
    if not all(hasattr(layer, p) for p in ("input_layernorm", "post_attention_layernorm", "mlp")):
        return False
    return callable(getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None))


def install(model: nn.Module) -> int:
    """Switch the last decoder layer of each Llama-style backbone inside `model`; returns how many.
    Idempotent. A model with hooks (offloading, ZeRO-3) keeps its layers as they are."""
    if hooked(model):
        return 0
    n = 0
    for m in model.modules():
        layer = _backbone_layer(m)
        if layer is None or not _shaped(layer):
            continue
        if "forward" not in layer.__dict__:
            layer.forward = _span_forward.__get__(layer)
        n += 1
    return n


def _unwrap(model):
    """The causal LM or sequence classifier inside DDP / PEFT / TokenValueModel wrappers."""
    for _ in range(6):
        inner = getattr(model, "module", None)  # DDP, accelerate's wrappers
        if isinstance(inner, nn.Module):
            model = inner
            continue
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            model = model.get_base_model()
            continue
        inner = getattr(model, "model", None)
        if type(model).__name__ == "TokenValueModel" and isinstance(inner, nn.Module):
            model = inner
            continue
        break
    return model


def layer_of(model: nn.Module) -> nn.Module | None:
    """The model's switched last layer, if its forward will run through one (so a span applies); else None."""
    lm = _unwrap(model)
    backbone = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    layer = _backbone_layer(backbone) if isinstance(backbone, nn.Module) else None
    if layer is None or getattr(layer.__dict__.get("forward"), "__func__", None) is not _span_forward:
        return None
    if getattr(layer, "gradient_checkpointing", False) and layer.training:
        return None  # the checkpoint's recompute would run outside the span
    return layer


def _span_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    sp = _SPAN.get()
    if sp is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    s, e = sp
    attn = self.self_attn
    impl = getattr(getattr(attn, "config", None), "_attn_implementation", None)
    mask = kwargs.get("attention_mask")
    pos_emb = kwargs.get("position_embeddings")
    plain = (not args and impl in _ATTENTION and pos_emb is not None
             and kwargs.get("use_cache") in (None, False) and kwargs.get("cache") is None
             and kwargs.get("past_key_values") is None
             and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4)))
    if not plain:
        return type(self).forward(self, hidden_states, *args, **kwargs)[:, s:e]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mod = sys.modules[type(attn).__module__]
    B, T, _ = hidden_states.shape
    D = attn.head_dim
    x = self.input_layernorm(hidden_states)
    xq = x[:, s:e]
    q = attn.q_proj(xq).view(B, e - s, -1, D)
    k = attn.k_proj(x).view(B, T, -1, D)
    v = attn.v_proj(x).view(B, T, -1, D).transpose(1, 2)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = pos_emb
    q, _ = mod.apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos[:, s:e], sin[:, s:e])
    k, _ = mod.apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if mask is None:  # no padding: causal over the whole sequence, the span's rows of it
        rows = torch.arange(s, e, device=x.device)[:, None]
        mask = (torch.arange(T, device=x.device)[None, :] <= rows)[None, None]
        if impl == "eager":
            add = torch.zeros(mask.shape, dtype=q.dtype, device=x.device)
            mask = add.masked_fill_(~mask, torch.finfo(q.dtype).min)
    else:
        mask = mask[:, :, s:e]
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, getattr(mod, "eager_attention_forward", None)) \
        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface") else ALL_ATTENTION_FUNCTIONS[impl]
    o, _ = fn(attn, q, k, v, mask, dropout=0.0 if not attn.training else attn.attention_dropout,
              scaling=attn.scaling)
    h = hidden_states[:, s:e] + attn.o_proj(o.reshape(B, e - s, -1).contiguous())
    return h + self.mlp(self.post_attention_layernorm(h))
