"""Fewer passes over memory for two building blocks on a CPU, same numbers: RMSNorm layers and LoRA linear layers.

A Llama-style norm layer (Qwen3: 4 per decoder layer, q/k norms included) computes `w · x / rms(x)` in six
tensor operations forward and about a dozen in its autograd backward, each a pass over the activations (on bench's
mid workload the norm layers took about a seventh of a PPO update).
torch ships a fused CPU forward (`aten::_fused_rms_norm`, which also returns 1/rms) but no CPU backward; the
backward below is the closed form

    x̂ = x·r,  r = (mean(x²) + ε)^-½,  y = w ⊙ x̂
    ∂L/∂x = r · (g⊙w) − x · r³ · mean((g⊙w) ⊙ x)        ∂L/∂w = Σ_rows g ⊙ x̂

in five passes over x, two of them matrix-vector products (four without the weight's gradient). `fuse_rms_norms`
switches a model's norm layers to it for fp32 CPU inputs only; any other input runs the layer's own forward. A
layer is switched only when its own forward gives the same output as the fused one on a probe input (so a norm of
another formula, such as Gemma's 1 + w, is left alone).

A PEFT LoRA linear layer computes `base(x) + B(A(x)) · s`: the scaling and the sum are two more passes over the
(tokens, out) output forward, and autograd adds a scaling pass and a sum of the two input gradients backward.
`LoraLinearFunction` puts the scaled low-rank term into the base product's output (one addmm) and the two input
gradients into one buffer (mm, then addmm), the weight gradients being the same products as autograd's.
`fuse_lora_linears` switches plain LoRA layers to it (one active adapter, no variant, no dropout at work, fp32 CPU
input, gradients enabled, no autocast, no hooks on the adapter's own layers); anything else runs PEFT's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf_cli.accel import cpu_linear

_OP = getattr(torch.ops.aten, "_fused_rms_norm", None)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _OP(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, rstd, w = ctx.saved_tensors
        d = x.shape[-1]
        gx = (g * x).reshape(-1, d)
        r = rstd.reshape(-1)
        c = r.pow(3).mul_(torch.mv(gx, w)).div_(d)  # r³ · mean((g⊙w) ⊙ x) per row, the sum as a matrix-vector product
        dx = (g * w).mul_(rstd).reshape(-1, d).addcmul_(x.reshape(-1, d), c[:, None], value=-1)
        dw = torch.mv(gx.t(), r) if ctx.needs_input_grad[1] else None  # Σ_rows g ⊙ x · r
        return dx.reshape(x.shape), dw, None


def _eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype is torch.float32 and x.device.type == "cpu" and self.weight.dtype is torch.float32:
        return RMSNormFunction.apply(x, self.weight, self._fused_eps)
    return type(self).forward(self, x)


def _agrees(module) -> bool:
    """The layer's own forward and the fused one give the same output (and input gradient) on a probe input."""
    d = module.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, d, generator=gen).mul_(3.0).requires_grad_(True)
    w = module.weight.detach().float().cpu()
    eps = module._fused_eps
    with torch.enable_grad():
        ref = type(module).forward(_Probe(w, module), x)
        ours = RMSNormFunction.apply(x, w, eps)
        if ref.shape != ours.shape or not torch.allclose(ref, ours, atol=1e-5, rtol=1e-4):
            return False
        g = torch.randn(3, d, generator=gen)
        (gr,) = torch.autograd.grad(ref, x, g)
        (go,) = torch.autograd.grad(ours, x, g)
    return torch.allclose(gr, go, atol=1e-5, rtol=1e-4)


class _Probe(nn.Module):
    """The norm layer's attributes with an fp32 CPU copy of its weight (the probe never touches the model)."""

    def __init__(self, weight: torch.Tensor, like: nn.Module) -> None:
        super().__init__()
        self.__dict__.update({k: v for k, v in like.__dict__.items() if not k.startswith("_")})
        self.weight = nn.Parameter(weight, requires_grad=False)


def fuse_rms_norms(model: nn.Module) -> int:
    """Switch the model's RMSNorm layers (class name ending in RMSNorm, a 1-D weight, an epsilon) to the fused
    kernel where it applies; returns how many were switched. Idempotent."""
    if _OP is None:
        return 0
    n, verdict = 0, {}
    for m in model.modules():
        if not type(m).__name__.endswith("RMSNorm") or "forward" in m.__dict__:
            continue
        w = getattr(m, "weight", None)
        eps = _eps(m)
        if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.numel() or eps is None or w.is_meta:
            continue
        m._fused_eps = eps
        key = (type(m), tuple(sorted((k, v) for k, v in m.__dict__.items()
                                     if isinstance(v, (int, float, bool, str)) and not k.startswith("_"))))
        if key not in verdict:
            verdict[key] = _agrees(m)
        if verdict[key]:
            m.forward = _fused_forward.__get__(m)
            n += 1
    return n


class LoraLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ with W, b frozen; gradients for x, A, B. The products with W go through
    `cpu_linear` (oneDNN where it is on)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        x2 = x.reshape(-1, x.shape[-1])
        h = torch.mm(x2, lora_a.t())
        y = cpu_linear.linear(x2, weight, bias)
        y.addmm_(h, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x2, h, weight, lora_a, lora_b)
        ctx.scaling, ctx.shape = scaling, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, h, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        g = gy.reshape(-1, gy.shape[-1])
        gh = torch.mm(g, lora_b).mul_(s)  # (tokens, r)
        gx = ga = gb = None
        if ctx.needs_input_grad[0]:
            gx = cpu_linear.mm_t(g, weight.t()).addmm_(gh, lora_a).view(ctx.shape)
        if ctx.needs_input_grad[3]:
            ga = torch.mm(gh.t(), x2)
        if ctx.needs_input_grad[4]:
            gb = torch.mm(g.t(), h).mul_(s)
        return gx, None, None, ga, gb, None


def _lora_parts(layer):
    """(W, b, A, B, scaling) of a plain LoRA linear layer in its current state, or None."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return None
    active = list(getattr(layer, "active_adapters", []))
    if len(active) != 1 or active[0] not in layer.lora_A or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    drop = layer.lora_dropout[name]
    a, b = layer.lora_A[name], layer.lora_B[name]
    if not (isinstance(drop, nn.Identity) or not drop.training) or type(a) is not nn.Linear or \
            type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (a, b, layer.base_layer)):
        return None
    base = layer.base_layer
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return None
    return base.weight, base.bias, a.weight, b.weight, float(layer.scaling[name])


def _fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    # Without gradients (sampling, scoring) PEFT's forward runs: it calls the base layer's own forward, which the
    # sampling steps switch to W·xᵀ (rollout.weight_first_linears); the function saves passes only backward.
    parts = None if args or kwargs or not torch.is_grad_enabled() else _lora_parts(self)
    if parts is not None and x.dtype is torch.float32 and x.device.type == "cpu" and \
            not torch.is_autocast_enabled("cpu") and all(t.dtype is torch.float32 for t in parts[:4] if t is not None):
        w, b, a, bw, s = parts
        return LoraLinearFunction.apply(x, w, b, a, bw, s)
    return type(self).forward(self, x, *args, **kwargs)


def fuse_lora_linears(model: nn.Module) -> int:
    """Switch the model's PEFT LoRA linear layers (over an `nn.Linear`) to `LoraLinearFunction` where it applies
    at call time; returns how many were switched. Idempotent."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft without LoRA
        return 0
    n = 0
    for m in model.modules():
        if type(m) is LoraLinear and isinstance(m.base_layer, nn.Linear) and "forward" not in m.__dict__:
            m.forward = _fused_lora_forward.__get__(m)
            n += 1
    return n
