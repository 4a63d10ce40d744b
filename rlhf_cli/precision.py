"""The precision rule, defined once and torch-free: the dtype that stores frozen weights and the one
activations and logits are computed in, from `model.dtype`, `device.mixed_precision` and what the machine has.
The stages get torch dtypes through `rlhf_cli.hardware.resolve_precision`; the doctor (`rlhf_cli.memory`) plans
with this directly.

Frozen weights (the reference / base, the reward model, frozen trunks) may be stored in bf16/fp16 to save
memory; every trainable parameter keeps fp32 master weights and optimizer state, and runs under autocast at
the compute dtype. auto: bf16 on GPUs that support it, fp16 on other GPUs, fp32 on the CPU (and where CUDA is
named but not there).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_cli.choices import DTYPES, MIXED_PRECISIONS
from rlhf_cli.errors import RlhfError

AUTOCAST = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}   # device.mixed_precision -> dtype name
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}     # dtype name -> short spelling


@dataclass(frozen=True)
class Precision:
    storage: str            # dtype name of frozen weights: float32 | bfloat16 | float16
    compute: str            # dtype name of activations and logits; float32: no autocast
    slow_cpu_bf16: bool = False  # bf16 compute on a CPU known to have no bf16 units (far slower than fp32)

    @property
    def autocast(self) -> str | None:
        """The autocast dtype name, None for fp32 compute."""
        return None if self.compute == "float32" else self.compute


def _or(names: tuple) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def _gpu_auto(accelerator: str, cuda_bf16: bool | None) -> str | None:
    """auto's 16-bit dtype on a GPU that is there (cuda_bf16 not None), else None (fp32)."""
    if accelerator == "cuda" and cuda_bf16 is not None:
        return "bfloat16" if cuda_bf16 else "float16"
    return None


def storage_dtype(name, accelerator: str, cuda_bf16: bool | None = None) -> str:
    """`model.dtype` -> the dtype name frozen weights are stored in."""
    if name is None or str(name) in ("auto", "None"):
        return _gpu_auto(accelerator, cuda_bf16) or "float32"
    if str(name) not in DTYPES:
        raise RlhfError(f"model.dtype={name} is not a torch dtype; use {_or(DTYPES)}")
    return str(name)


def autocast_dtype(name, accelerator: str, cuda_bf16: bool | None = None) -> str | None:
    """`device.mixed_precision` -> the autocast dtype name, or None for fp32 compute."""
    name = "auto" if name is None else str(name)
    if name == "auto":
        return _gpu_auto(accelerator, cuda_bf16)
    if name not in MIXED_PRECISIONS:
        raise RlhfError(f"device.mixed_precision={name} is unknown; use {_or(MIXED_PRECISIONS)}")
    return None if AUTOCAST[name] == "float32" else AUTOCAST[name]


def precision(dtype, mixed_precision, accelerator: str, *, cuda_bf16: bool | None = None,
              cpu_bf16: bool | None = None) -> Precision:
    """(storage, compute) dtype names. cuda_bf16: None where no CUDA device is there, else whether it
    supports bf16; cpu_bf16: whether the CPU has bf16 matmul units (None: unknown). fp32 compute over 16-bit
    frozen weights runs at their dtype (16-bit weights cannot meet fp32 activations in a matmul)."""
    accelerator = str(accelerator)
    storage = storage_dtype(dtype, accelerator, cuda_bf16)
    compute = autocast_dtype(mixed_precision, accelerator, cuda_bf16) or storage
    slow = accelerator == "cpu" and compute == "bfloat16" and cpu_bf16 is False
    return Precision(storage, compute, slow)
