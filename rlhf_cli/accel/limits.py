"""Where and from which sizes the speed paths switch, torch-free so that the doctor can plan with them."""

import functools
import platform
import re
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


# AMD CPU families on which oneDNN's fp32 linear was measured well ahead of torch's BLAS: from Zen 5 (family 26) on
# (MKL runs its AVX2 kernels there). On Zen 4 (family 25) the two are close, oneDNN behind on narrow layers
# (bench/results/NOTES.md has the figures)
ONEDNN_AMD_FAMILY_FROM = 26


def onednn_by_default() -> bool:
    """`device.cpu_matmul=auto`: whether PPO's fp32 linear layers take oneDNN on this CPU, decided by the CPU's kind
    and never by timing (a timed check can decide one way in a run and the other in its resumed part, which then
    computes other numbers): AMD CPUs from family `ONEDNN_AMD_FAMILY_FROM` on. Intel CPUs (MKL's own AVX-512
    kernels, not measured against oneDNN), older AMD ones and every other CPU keep torch's BLAS."""
    fields = cpu_fields()
    if fields:
        vendor, family = fields.get("vendor_id", ""), fields.get("cpu family", "")
    else:  # no /proc/cpuinfo (Windows: "AMD64 Family 26 Model 2 Stepping 0, AuthenticAMD")
        proc = platform.processor()
        vendor = proc.rsplit(",", 1)[-1].strip()
        found = re.search(r"Family (\d+)", proc)
        family = found.group(1) if found else ""
    return vendor == "AuthenticAMD" and family.isdigit() and int(family) >= ONEDNN_AMD_FAMILY_FROM


def cpu_kind() -> str:
    """The CPU's model name, maker and family as /proc/cpuinfo gives them (what `onednn_by_default` reads)."""
    f = cpu_fields()
    if not f:
        return platform.processor() or platform.machine() or "unknown CPU"
    name = f.get("model name", "unknown model")
    return f"{name} ({f.get('vendor_id', '?')} family {f.get('cpu family', '?')})"
