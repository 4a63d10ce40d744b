"""`rlhf doctor [recipe=NAME] [device=...]`: library versions, devices, hub reachability, and a memory plan
per process for the recipe's training stages (rlhf_cli.memory), with what to change when it does not fit.

Imports no trainer library: versions come from package metadata, torch is imported once for the device report,
and each hub gets one TCP connection attempt with a short timeout (no retries), all in parallel.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
import time
from importlib import metadata
from urllib.parse import urlparse

from rlhf_cli import memory as M
from rlhf_cli.errors import RlhfError

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "datasets", "hydra-core",
            "modelscope")
COMMON_GPU_GIB = (16, 24, 40, 48, 80, 141)


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def devices() -> dict:
    """CUDA availability, GPUs (name, total / free memory, bf16), CPU cores and memory."""
    import psutil

    vm = psutil.virtual_memory()
    info = {"cpu_count": os.cpu_count(), "ram_total": vm.total, "ram_available": vm.available, "cuda": False,
            "gpus": [], "torch_cuda": None}
    try:
        import torch
    except ImportError:
        return info
    info["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["cuda"] = True
        info["bf16"] = torch.cuda.is_bf16_supported()
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            info["gpus"].append({"name": torch.cuda.get_device_name(i), "total": total, "free": free})
    return info


def _hosts() -> dict[str, tuple[str, int]]:
    hf = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    ms = urlparse(os.environ.get("MODELSCOPE_DOMAIN_URL") or "https://www.modelscope.cn")
    return {"ModelScope": (ms.hostname or "www.modelscope.cn", ms.port or 443),
            "Hugging Face hub": (hf.hostname or "huggingface.co", hf.port or 443)}


def reachability(timeout: float = 2.0) -> dict[str, str]:
    """One TCP connection per hub (name resolution included), in parallel; a hub that has not answered when
    the timeout is up is reported as such (its thread is abandoned, not waited for)."""
    hosts = _hosts()
    results: dict[str, str] = {}

    def probe(name: str, host: str, port: int) -> None:
        t0 = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout):
                results[name] = f"reachable ({host}, {1000 * (time.perf_counter() - t0):.0f} ms)"
        except OSError as e:
            results[name] = f"unreachable ({host}: {type(e).__name__}: {str(e) or 'no answer'})"

    threads = [threading.Thread(target=probe, args=(n, h, p), daemon=True) for n, (h, p) in hosts.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 0.3
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    for name, (host, _) in hosts.items():
        results.setdefault(name, f"unreachable ({host}: no answer within {timeout:g} s)")
    return results


def _capacity(cfg, s: M.Setup, dev: dict) -> tuple[float | None, str]:
    """Memory one process may use, and where the figure comes from."""
    gib = cfg.doctor.get("memory_gib")
    if gib:
        return float(gib) * M.GiB, f"doctor.memory_gib={gib}"
    if s.accelerator == "cuda":
        if dev["gpus"]:
            g = min(dev["gpus"], key=lambda x: x["total"])
            return float(g["total"]), f"{g['name']}, {M.fmt_bytes(g['total'])}"
        return None, "no GPU visible here"
    share = dev["ram_available"] / max(s.per_machine, 1)
    return share, (f"available RAM {M.fmt_bytes(dev['ram_available'])}"
                   + (f" / {s.per_machine} processes" if s.per_machine > 1 else ""))


def _verdict(plan: M.StagePlan, cap: float | None) -> str:
    if cap is None:
        fits = [g for g in COMMON_GPU_GIB if plan.peak <= g * M.GiB]
        return (f"needs {M.fmt_bytes(plan.peak)} per GPU: fits GPUs of {fits[0]} GiB or more" if fits else
                f"needs {M.fmt_bytes(plan.peak)} per GPU: more than any single GPU; shard it (see below)")
    ok = plan.peak <= cap
    return f"{'fits' if ok else 'DOES NOT FIT'}: {M.fmt_bytes(plan.peak)} of {M.fmt_bytes(cap)} " \
           f"({100 * plan.peak / cap:.0f}%)"


def report(cfg) -> str:
    lines: list[str] = []
    timeout = float(cfg.doctor.get("timeout_s") or 2)
    hub_thread_result: dict = {}
    hub_thread = threading.Thread(target=lambda: hub_thread_result.update(reachability(timeout)), daemon=True)
    hub_thread.start()  # the hubs are asked while torch is imported

    v = versions()
    lines.append(f"rlhf doctor: recipe {cfg.recipe}, device {cfg.device.name}")
    lines.append("versions")
    lines.append("  " + ", ".join(f"{k} {val}" for k, val in v.items() if val) +
                 "".join(f"; {k} not installed" for k, val in v.items() if not val))
    dev = devices()
    lines.append("devices")
    if dev["cuda"]:
        for i, g in enumerate(dev["gpus"]):
            lines.append(f"  GPU {i}: {g['name']}, {M.fmt_bytes(g['total'])} ({M.fmt_bytes(g['free'])} free)")
        lines.append(f"  bf16: {'supported' if dev.get('bf16') else 'not supported (fp16 instead)'}")
    else:
        why = ("torch built without CUDA" if dev["torch_cuda"] is None
               else f"torch built for CUDA {dev['torch_cuda']}")
        lines.append(f"  CUDA: not available ({why}); bf16 training needs a GPU here")
    lines.append(f"  CPU: {dev['cpu_count']} cores, RAM {M.fmt_bytes(dev['ram_available'])} available of "
                 f"{M.fmt_bytes(dev['ram_total'])}")
    hub_thread.join(timeout + 0.5)
    lines.append(f"hubs (one connection each, {timeout:g} s timeout)")
    for name in _hosts():
        lines.append(f"  {name}: {hub_thread_result.get(name, f'no answer within {timeout:g} s')}")

    try:
        arch, source = M.arch_for_model(cfg.model)
    except ValueError as e:
        raise RlhfError(str(e)) from None
    s = M.setup_from(cfg, len(dev["gpus"]))
    lines.append(f"model {cfg.model.name_or_path} (values from {source})")
    lines.append(f"  vocab {arch.vocab_size}, hidden {arch.hidden_size}, {arch.num_hidden_layers} layers, "
                 f"{arch.num_attention_heads} heads / {arch.num_key_value_heads} kv heads × {arch.head_dim}, "
                 f"intermediate {arch.intermediate_size}, {'tied' if arch.tie_word_embeddings else 'untied'} "
                 f"embeddings: {M.causal_lm_params(arch) / 1e6:.1f}M parameters "
                 f"({M.seq_cls_params(arch) / 1e6:.1f}M as a reward / value model)")
    where = f"{s.per_machine} process(es) per machine × {s.world // max(s.per_machine, 1)} machine(s)"
    zero = f", ZeRO-{s.zero_stage}" if s.zero_stage else ""
    lines.append(f"memory plan per process: device {cfg.device.name} ({s.strategy}{zero}), {where}, "
                 f"weights in {s.dtype_name}; sequences at the configured maximum lengths (real batches are "
                 "padded to their longest row)")
    cap, cap_src = _capacity(cfg, s, dev)
    lines.append(f"  against: {cap_src}")
    for stage in cfg.doctor.stages:
        stage = str(stage)
        if stage not in M.PLANNERS:
            raise RlhfError(f"doctor.stages: {stage} has no memory plan; choose from {', '.join(M.PLANNERS)}")
        plan = M.plan_stage(cfg, stage, arch, s)
        lines += M.format_plan(plan)
        if stage == "ppo" and s.strategy in ("deepspeed", "fsdp"):
            lines.append("    note: ppo runs under ddp only; this plan is its ddp plan")
        lines.append(f"    -> {_verdict(plan, cap)}")
        if plan.offloaded:
            lines.append(f"    offloaded to CPU memory: {M.fmt_bytes(plan.offloaded)} per process")
        need = cap if cap is not None else (M.GiB * COMMON_GPU_GIB[1] if s.accelerator == "cuda" else None)
        if need is not None and plan.peak > need:
            label = "to fit" + (" a 24 GiB GPU" if cap is None else "")
            singles, combo = M.remedies(cfg, stage, arch, s, need)
            if singles:
                lines.append(f"    {label}, any of: " + "; ".join(f"{what} -> {M.fmt_bytes(p.peak)}"
                                                                for what, p in singles[:4]))
            elif combo:
                lines.append(f"    {label}, together: {combo[0]} -> {M.fmt_bytes(combo[1].peak)}")
            else:
                lines.append(f"    {label}: smaller micro-batches, activation checkpointing and ZeRO-3 "
                             "offload are not enough; shorten the sequences or use larger GPUs")
    return "\n".join(lines)


def run(cfg) -> None:
    print(report(cfg))
