"""fp32 linear layers on the CPU through oneDNN rather than the BLAS that `F.linear` calls.

torch's CPU wheels send an fp32 `F.linear` to MKL. On AMD CPUs MKL runs its AVX2 kernels, at about half of what
an AVX-512 chip can do, and oneDNN's `mkldnn._linear_pointwise` (the op torch's own CPU inductor emits) runs the
PPO update's products faster, forward and both backward products, with fp32 accumulation (tests/test_cpu_linear.py:
F.linear's outputs and gradients within 1e-4; bench/results/ has the measured rates). With a handful of rows (the
sampling steps) oneDNN is the slower one, so layers keep `F.linear` under `MIN_ROWS` rows.

`device.cpu_matmul` picks: auto (oneDNN on the CPUs `limits.onednn_by_default` names, where it was measured well
ahead; BLAS elsewhere), blas, or onednn. Only plain `nn.Linear` layers of models without hooks switch (`install`);
bf16 / fp16 tensors, autocast, GPUs and non-fp32 weights always take `F.linear`. Measure a CPU:
bench/probes/linear_probe.py --onednn.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from rlhf_cli.accel.limits import ONEDNN_CACHE_BYTES, ONEDNN_CACHE_CAPACITY, ONEDNN_MIN_DIM, onednn_by_default
from rlhf_cli.choices import CPU_MATMUL as MODES  # device.cpu_matmul's values

log = logging.getLogger("rlhf")

MIN_ROWS = 32        # fewer rows than this: F.linear (oneDNN is slower at 1 row, mixed at 8, faster from 32)
# weights with a side under MIN_DIM keep F.linear: tiny models gain nothing, and every product oneDNN compiles costs
# memory (below)
MIN_DIM = ONEDNN_MIN_DIM
# mode: set_mode's; on: whether oneDNN is used, None until auto's rule is read (at the first product that would use
# it, so a run whose products all keep F.linear never loads oneDNN)
_state: dict = {"mode": "blas", "on": False}
# oneDNN keeps a compiled primitive per product shape, in two caches of 1,024 entries by default (oneDNN's and
# ideep's): the PPO epochs' row counts change with every micro-batch's length, so unbounded they grow a process by
# about 2 MB per new row count. 32 entries hold a policy's and a value model's forward and backward products for one
# row count (~21 shapes); a new primitive is cheap to compile.
CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CACHE_CAPACITY = ONEDNN_CACHE_CAPACITY
CACHE_BYTES = ONEDNN_CACHE_BYTES


def available() -> bool:
    """Whether this torch has the oneDNN linear op on the CPU."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T (2-D, fp32) through oneDNN; strided views (transposes) go in as they are."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def bound_caches(capacity: int = CACHE_CAPACITY) -> None:
    """Cap oneDNN's and ideep's primitive caches (read once, at their first use; a value the user set stays)."""
    for var in CACHE_VARS:
        os.environ.setdefault(var, str(capacity))


def resolve(mode: str) -> bool:
    """Whether `mode` (`MODES`) means oneDNN in this process (auto: `limits.onednn_by_default`)."""
    if mode not in MODES:
        raise ValueError(f"cpu_matmul must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "blas" or not available() or (mode == "auto" and not onednn_by_default()):
        return False
    bound_caches()
    return True


def set_mode(mode: str) -> None:
    """Switch the process's CPU fp32 linears to oneDNN or back (`MODES`); auto's rule is read at the first product
    that would use oneDNN."""
    if mode not in MODES:
        raise ValueError(f"cpu_matmul must be one of {', '.join(MODES)}, got {mode!r}")
    _state["mode"] = mode
    _state["on"] = None if mode == "auto" else resolve(mode)


def enabled() -> bool:
    """Whether oneDNN is on (auto's rule read at the first call)."""
    if _state["on"] is None:
        _state["on"] = resolve(_state["mode"])
    return _state["on"]


def _may_use() -> bool:
    """Whether oneDNN could be on, without reading auto's rule."""
    return _state["on"] is not False


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm_t(gy, weight.t())               # gy @ W
        if ctx.needs_input_grad[1]:
            gw = _mm_t(gy.t(), x2.t())               # gyᵀ @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.sum(0)
        return gx, gw, gb


def mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T for 2-D tensors (b may be a transposed view), through oneDNN under the same rules as `linear`."""
    if _may_use() and a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 and \
            a.shape[0] >= MIN_ROWS and min(b.shape) >= MIN_DIM and not torch.is_autocast_enabled("cpu") \
            and enabled():
        return _mm_t(a, b)
    return torch.mm(a, b.t())


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` sends this product to oneDNN."""
    return (_may_use() and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.dim() == 2 and x.dim() >= 2
            and min(weight.shape) >= MIN_DIM
            and (bias is None or bias.dtype == torch.float32)
            and type(weight) in (torch.Tensor, nn.Parameter)
            and x.numel() >= MIN_ROWS * x.shape[-1] > 0
            and not torch.is_autocast_enabled("cpu")
            and enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN where `applies` says so."""
    if not applies(x, weight, bias):
        return nn.functional.linear(x, weight, bias)
    k = x.shape[-1]
    y = _OneDNNLinear.apply(x.reshape(-1, k), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def is_installed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _forward


def install(model: nn.Module) -> int:
    """Route the model's plain `nn.Linear` layers with both sides ≥ `MIN_DIM` through `linear`; returns how many.
    Idempotent. A model with hooks (offloading, ZeRO-3) keeps its layers as they are, and nothing switches while
    oneDNN is off or unavailable."""
    from rlhf_cli.accel.decode import hooked

    if not _may_use() or not available() or hooked(model):
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and ("forward" not in m.__dict__ or is_installed(m)):
            if type(m.weight) not in (torch.Tensor, nn.Parameter) or min(m.weight.shape) < MIN_DIM:
                continue
            m.forward = _forward.__get__(m)
            n += 1
    return n
