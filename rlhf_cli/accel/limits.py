"""Where and from which sizes the speed paths switch, torch-free so that the doctor can plan with them."""

import functools
import platform
from pathlib import Path

from rlhf_cli.choices import FAST_PATHS

PROVEN_ON = ("cpu",)  # device types on which `device.fast_paths=auto` turns the paths on


def enabled(mode: str, device_type: str) -> bool:
    """Whether `device.fast_paths=mode` turns the speed paths on for a device of this type ("cpu", "cuda", ...)."""
    if mode not in FAST_PATHS:
        raise ValueError(f"device.fast_paths must be one of {', '.join(FAST_PATHS)}, got {mode!r}")
    return device_type in PROVEN_ON if mode == "auto" else mode == "on"


# Sampling with a LoRA policy merges W + B·A into a copy of each adapted weight. On a CPU that copy, once per
# rollout, outweighs the adapter's small per-step products when the weights are large (bench/probes/merge_probe.py);
# small models merge, as every model does on a GPU where the copy is cheap.
CPU_MERGE_MAX_BYTES = 256 * 2**20
# Scoring forwards run micro-batches of rows grouped by prompt length only where one forward over the rollout chunk
# would hold more fp32 logits than this (below it, grouping costs more forwards than the padding it saves).
SCORE_GROUPS_FROM_BYTES = 64 * 2**20
# oneDNN linear layers: weights with a side under this keep F.linear (small products gain nothing), and each of the
# two primitive caches holds this many compiled products (both full: about 0.8 MiB a product).
ONEDNN_MIN_DIM = 128
ONEDNN_CACHE_CAPACITY = 32
ONEDNN_CACHE_BYTES = ONEDNN_CACHE_CAPACITY * 0.8 * 2**20


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (vendor_id, cpu family, ...); {} where there is no such file."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {}
    pairs = (ln.split(":", 1) for ln in info.splitlines()[:40] if ":" in ln)
    return {k.strip(): v.strip() for k, v in pairs}


# x86-64 makers whose CPUs get MKL's AVX2 kernels for fp32 products, not its AVX-512 ones
ONEDNN_VENDORS = ("AuthenticAMD", "HygonGenuine")


def onednn_by_default() -> bool:
    """`device.cpu_matmul=auto`: whether PPO's fp32 linear layers take oneDNN on this CPU, decided by the CPU's
    maker and never by timing (a timed check can decide one way in a run and the other in its resumed part, which
    then computes other numbers). On AMD CPUs MKL runs its AVX2 kernels and oneDNN's linear runs the PPO products
    1.6-2.4x faster (bench/results/NOTES.md); Intel CPUs (MKL's own AVX-512 kernels, not measured against oneDNN)
    and every other CPU keep torch's BLAS."""
    vendor = cpu_fields().get("vendor_id") or platform.processor()
    return any(v in vendor for v in ONEDNN_VENDORS)
