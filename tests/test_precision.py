"""The precision rule (rlhf_cli.precision): a table of cases to check by hand, and the doctor and the stages
applying the same rule."""

from __future__ import annotations

import pytest

from rlhf_cli.errors import RlhfError
from rlhf_cli.precision import Precision, precision

F32, BF16, F16 = "float32", "bfloat16", "float16"
GPU_BF16, GPU_F16, NO_GPU = True, False, None   # cuda_bf16: a GPU with bf16, one without, no CUDA here


@pytest.mark.parametrize("dtype,mp,acc,cuda,storage,compute", [
    # auto is fp32 on the CPU, bf16 on a GPU that has it, fp16 on one that does not
    ("auto", "auto", "cpu", NO_GPU, F32, F32),
    ("auto", "auto", "cuda", GPU_BF16, BF16, BF16),
    ("auto", "auto", "cuda", GPU_F16, F16, F16),
    (None, None, "cpu", NO_GPU, F32, F32),                 # null is auto
    # CUDA named but not there (a CPU-only machine running device=cuda's numbers): fp32
    ("auto", "auto", "cuda", NO_GPU, F32, F32),
    # explicit choices are kept; autocast over fp32 weights
    ("float32", "bf16", "cpu", NO_GPU, F32, BF16),
    ("float32", "fp16", "cuda", GPU_BF16, F32, F16),
    ("float32", "no", "cuda", GPU_BF16, F32, F32),
    ("float32", "auto", "cuda", GPU_BF16, F32, BF16),
    # fp32 compute over 16-bit frozen weights runs at their dtype
    ("bfloat16", "no", "cpu", NO_GPU, BF16, BF16),
    ("float16", "auto", "cpu", NO_GPU, F16, F16),
    ("bfloat16", "auto", "cuda", GPU_F16, BF16, F16),      # autocast fp16 over bf16 weights: as asked
])
def test_precision_table(dtype, mp, acc, cuda, storage, compute):
    p = precision(dtype, mp, acc, cuda_bf16=cuda)
    assert (p.storage, p.compute) == (storage, compute)
    assert p.autocast == (None if compute == F32 else compute)


@pytest.mark.parametrize("acc,mp,cpu_bf16,slow", [
    ("cpu", "bf16", False, True),     # bf16 compute on a CPU without bf16 units: the stages warn
    ("cpu", "bf16", True, False),
    ("cpu", "bf16", None, False),     # unknown: no warning
    ("cpu", "no", False, False),
    ("cuda", "bf16", False, False),   # the CPU's units do not matter on a GPU
])
def test_slow_cpu_bf16(acc, mp, cpu_bf16, slow):
    assert precision("float32", mp, acc, cuda_bf16=True, cpu_bf16=cpu_bf16).slow_cpu_bf16 is slow


@pytest.mark.parametrize("dtype,mp,needle", [
    ("bf17", "auto", "model.dtype=bf17 is not a torch dtype; use auto, float32, bfloat16 or float16"),
    ("auto", "fp8", "device.mixed_precision=fp8 is unknown; use auto, no, bf16 or fp16"),
])
def test_bad_names(dtype, mp, needle):
    with pytest.raises(RlhfError, match=needle):
        precision(dtype, mp, "cpu")


def test_the_stages_and_the_doctor_apply_the_same_rule():
    """hardware.resolve_precision (torch dtypes, this machine) and memory.setup_from (names, the recipe's
    device) agree on a CPU, where they see the same machine."""
    torch = pytest.importorskip("torch")
    from rlhf_cli import memory as M
    from rlhf_cli.config import compose
    from rlhf_cli.hardware import resolve_precision
    from rlhf_cli.settings import of

    for ov in ([], ["model.dtype=bfloat16"], ["device.mixed_precision=bf16"], ["model.dtype=float16"]):
        cfg = compose("ppo", ov)
        storage, compute = resolve_precision(of(cfg))
        s = M.setup_from(cfg)
        assert str(storage).removeprefix("torch.") == s.dtype_name
        assert s.compute_name == {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[compute]


def test_precision_is_a_value():
    assert precision("auto", "auto", "cpu") == Precision(F32, F32)
