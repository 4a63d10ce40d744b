"""Where the kernel tests run: the CPU always (sdpa and eager attention), and CUDA with each attention
implementation, marked `gpu` and skipped without a GPU (`bench/gpu_check.sh` runs them: `pytest -m gpu`).
flash_attention_2 computes in half precision only, so its cases run in bf16 with bf16's tolerance, and only where
the flash-attn package is installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

FLASH = "flash_attention_2"
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NO_FLASH = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")


def on_cuda(*values, id: str | None = None, flash: bool = False):
    """A parameter set that runs on a CUDA device only."""
    return pytest.param(*values, id=id, marks=[pytest.mark.gpu, NO_CUDA, *([NO_FLASH] if flash else [])])


CUDA = on_cuda("cuda", id="cuda")
# (device, attention implementation)
PLACES = [pytest.param("cpu", "sdpa", id="cpu-sdpa"), pytest.param("cpu", "eager", id="cpu-eager"),
          *(on_cuda("cuda", a, id=f"cuda-{a}", flash=a == FLASH) for a in ("sdpa", "eager", FLASH))]


def dtype_for(attn: str) -> torch.dtype:
    return torch.bfloat16 if attn == FLASH else torch.float32


def tolerance(attn: str) -> dict:
    """assert_close's tolerance: fp32's for two fp32 paths that sum in another order, bf16's for flash."""
    return dict(atol=2e-2, rtol=2e-2) if attn == FLASH else dict(atol=1e-6, rtol=1e-5)
