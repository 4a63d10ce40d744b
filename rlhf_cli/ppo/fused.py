"""RMSNorm in one kernel on a CPU: the models' own norm layers, same numbers, fewer passes over memory.

A Llama-style norm layer (Qwen3: 4 per decoder layer, q/k norms included) computes `w · x / rms(x)` in six
tensor operations forward and about a dozen in its autograd backward. Measured on the mid workload (1 thread,
(8, 88, 256) fp32): 0.35 ms forward and 1.5 ms forward + backward per layer, ~0.4 s of each 2.7 s PPO update.
torch ships a fused CPU forward (`aten::_fused_rms_norm`, which also returns 1/rms) but no CPU backward; the
backward below is the closed form

    x̂ = x·r,  r = (mean(x²) + ε)^-½,  y = w ⊙ x̂
    ∂L/∂x = r · (g⊙w) − x · r³ · mean((g⊙w) ⊙ x)        ∂L/∂w = Σ_rows g ⊙ x̂

in four passes over x (three without the weight's gradient). `fuse_rms_norms` switches a model's norm layers to
it for fp32 CPU inputs only; any other input runs the layer's own forward. A layer is switched only when its own
forward gives the same output as the fused one on a probe input (so a norm of another formula, such as Gemma's
1 + w, is left alone).
"""

from __future__ import annotations

import torch
from torch import nn

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
        gw = g * w
        dot = (gw * x).sum(-1, keepdim=True)
        dx = torch.addcmul(gw.mul_(rstd), x, rstd.pow(3).mul_(dot).div_(x.shape[-1]), value=-1)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (g * x).mul_(rstd).reshape(-1, x.shape[-1]).sum(0)
        return dx, dw, None


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
