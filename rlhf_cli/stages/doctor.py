"""`rlhf doctor [recipe=NAME] [device=...]`: library versions, devices, hub reachability, and a memory plan
per process for the recipe's training stages (rlhf_cli.memory), with what to change when it does not fit.

Imports no trainer library: versions come from package metadata, torch is imported once for the device report,
and each hub gets one TCP connection attempt with a short timeout (no retries), all in parallel. The plan's
sequence lengths come from the training data, tokenized with the model's tokenizer, when both are on this
machine (nothing is downloaded; the tiny base is built here as every stage builds it).
"""

from __future__ import annotations

import math
import os
import platform
import random
import socket
import threading
import time
from importlib import metadata
from pathlib import Path

from rlhf_cli import memory as M
from rlhf_cli import settings
from rlhf_cli.accel.limits import ONEDNN_AMD_FAMILY_FROM, ONEDNN_MIN_DIM, cpu_kind, onednn_by_default
from rlhf_cli.errors import RlhfError
from rlhf_cli.tiny import is_tiny_spec

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "datasets", "hydra-core",
            "modelscope")
COMMON_GPU_GIB = (16, 24, 40, 48, 80, 141)
# examples tokenized at most per split (a seeded sample of larger data): seconds, not minutes
SAMPLE_ROWS = 5000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
    from rlhf_cli.hardware import cpu_bf16_native

    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["cpu_bf16"] = cpu_bf16_native()
    if torch.cuda.is_available():
        info["cuda"] = True
        info["bf16"] = torch.cuda.is_bf16_supported()
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            info["gpus"].append({"name": torch.cuda.get_device_name(i), "total": total, "free": free})
    return info


def _hosts() -> dict[str, tuple[str, int]]:
    from rlhf_cli.sources import hub_hosts

    hosts = hub_hosts()
    return {"ModelScope": hosts["modelscope"], "Hugging Face hub": hosts["hf"]}


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


# -------------------------------------------------------------------------------------------- data lengths
def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_dir(run) -> tuple[Path | None, str]:
    """(a local directory holding the tokenizer the stages use, or None, and why). Never downloads: the SFT
    output (what ppo tokenizes with) when it exists, else the base model - the tiny one is built here, as
    every stage builds it; a local directory as it is; a hub id only from the local caches."""
    sft_out = Path(str(run.ppo.policy_dir)).expanduser()
    if _has_tokenizer(sft_out):
        return sft_out, str(sft_out)
    name = str(run.model.name_or_path)
    if is_tiny_spec(name):
        from rlhf_cli.sources import base_model_dir

        return base_model_dir(run), f"{run.model.tiny.dir} (the tiny base)"
    local = Path(name).expanduser()
    if local.is_dir():
        return (local, str(local)) if _has_tokenizer(local) else (None, f"{local} has no tokenizer files")
    for d in M.cached_model_dirs(name, run.model.cache_dir):
        if _has_tokenizer(d):
            return d, str(d)
    return None, (f"no tokenizer of {name} on this machine (not in the local hub caches; the doctor "
                  "downloads nothing)")


def _token_counts(tok, texts: list[str]) -> list[int]:
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]] if texts else []


def _p95(xs: list[int]) -> int:
    return sorted(xs)[max(math.ceil(0.95 * len(xs)) - 1, 0)]


def _sample(examples: list, n: int) -> list:
    return examples if len(examples) <= n else random.Random(0).sample(examples, n)


def data_lengths(run) -> M.Lengths:
    """Token lengths of the training data as the stages render it (prompt: chat template + assistant header;
    rows: prompt + answer + EOS), tokenized with the model's tokenizer; the prompts longer than
    data.max_prompt_length are left out, as the stages drop them. Lengths() with the reason when the data or
    the tokenizer is not on this machine. Larger data sets are sampled (SAMPLE_ROWS per split).

    The plan takes the longest of each, not a percentile: every batch is padded to its longest row, and over
    a run the batches meet the longest rows of the data."""
    from rlhf_cli import data as D

    d = run.data
    if not d.train_path:
        return M.Lengths(source="no data: data.train_path is not set")
    for key in ("train_path", "eval_path"):
        v = d[key]
        if v and not Path(str(v)).expanduser().is_file():
            return M.Lengths(source=f"no data: data.{key}={v} is not a local file (the doctor downloads "
                                    "nothing)")
    from rlhf_cli.models import load_tokenizer

    try:
        tok_dir, where = tokenizer_dir(run)
        if tok_dir is None:
            return M.Lengths(source=f"data not tokenized: {where}")
        tok = load_tokenizer(tok_dir, run.model)
        train, evals = D.load_examples(d, need_rejected=False, need_answers=False)
    except (RlhfError, OSError, ValueError) as e:  # a broken tokenizer directory or data file: report, go on
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return M.Lengths(source=f"data not read: {first}")
    n_train = len(train)
    train, evals = _sample(train, SAMPLE_ROWS), _sample(evals, SAMPLE_ROWS)
    thinking, templ = bool(run.model.enable_thinking), bool(d.chat_template)
    cap = int(d.max_prompt_length)

    def rendered(examples):
        """(example, prompt text, prompt tokens) of the examples whose prompt the stages keep."""
        prompts = [D.prompt_text(tok, ex.prompt, thinking, templ) for ex in examples]
        return [(ex, pt, n) for ex, pt, n in zip(examples, prompts, _token_counts(tok, prompts)) if n <= cap]

    kept_train, kept_eval = rendered(train), rendered(evals)
    if not kept_train:
        return M.Lengths(source=f"data not used: every sampled prompt is longer than "
                                f"data.max_prompt_length={cap}")
    prompt_lens = [n for _, _, n in kept_train]
    kept = kept_train + kept_eval
    eos = tok.eos_token or ""
    chosen = _token_counts(tok, [pt + ex.chosen + eos for ex, pt, _ in kept])
    rejected = _token_counts(tok, [pt + ex.rejected + eos for ex, pt, _ in kept if ex.rejected is not None])
    sft = chosen + (rejected if bool(d.sft_on_rejected) else [])
    sampled = f" (a sample of {len(train)})" if len(train) < n_train else ""
    source = (f"{n_train} training prompts{sampled} of {d.train_path}"
              + (f" and {len(evals)} eval examples" if evals else "")
              + f", tokenized with {where}: prompts longest {max(prompt_lens)}, 95th percentile "
              f"{_p95(prompt_lens)} tokens; prompt + answer longest {max(chosen + rejected)}. The plan takes "
              "the longest (every batch is padded to its longest row)")
    return M.Lengths(prompt=max(prompt_lens), sft=max(sft), reward=max(chosen + rejected), source=source)


def _capacity(run, s: M.Setup, dev: dict) -> tuple[float | None, str]:
    """Memory one process may use, and where the figure comes from."""
    gib = run.doctor.memory_gib
    if gib:  # as given: doctor.memory_gib=16, not the float 16.0 the setting holds
        return float(gib) * M.GiB, f"doctor.memory_gib={int(gib) if float(gib).is_integer() else gib}"
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


def _machine_lines(run) -> tuple[list[str], dict]:
    """Versions, devices and hub reachability (the hubs are asked while torch is imported), and the devices."""
    timeout = float(run.doctor.timeout_s)
    hub_thread_result: dict = {}
    hub_thread = threading.Thread(target=lambda: hub_thread_result.update(reachability(timeout)), daemon=True)
    hub_thread.start()
    v = versions()
    lines = [f"rlhf doctor: recipe {run.recipe}, device {run.device.name}", "versions"]
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
    bf16 = {True: "bf16 units (AVX512-BF16 / AMX)", False: "no bf16 units: use fp32 on the CPU",
            None: "bf16 units unknown"}[dev.get("cpu_bf16")]
    lines.append(f"  CPU: {dev['cpu_count']} cores ({dev.get('cpu_capability', '?')}, {bf16}), RAM "
                 f"{M.fmt_bytes(dev['ram_available'])} available of {M.fmt_bytes(dev['ram_total'])}")
    if str(run.device.get("accelerator")) == "cpu":
        lines.append(f"  {cpu_kind()}: PPO's fp32 linear layers run on {cpu_matmul_kernel(run)}")
    hub_thread.join(timeout + 0.5)
    lines.append(f"hubs (one connection each, {timeout:g} s timeout)")
    for name in _hosts():
        lines.append(f"  {name}: {hub_thread_result.get(name, f'no answer within {timeout:g} s')}")
    return lines, dev


def cpu_matmul_kernel(run) -> str:
    """Which kernels PPO's fp32 linear layers take on this CPU with the run's settings `run`
    (rlhf_cli.accel.cpu_linear), and why."""
    d = run.device
    mode = str(d.get("cpu_matmul") or "auto")
    if str(d.get("fast_paths")) == "off":
        return "torch's BLAS (device.fast_paths=off)"
    if mode == "auto":
        rule = f"device.cpu_matmul=auto: oneDNN on AMD family {ONEDNN_AMD_FAMILY_FROM} and later"
        if onednn_by_default():
            return f"oneDNN ({rule})"
        return f"torch's BLAS ({rule}; device.cpu_matmul=onednn tries it)"
    if mode == "onednn":
        return f"oneDNN (device.cpu_matmul=onednn), layers at least {ONEDNN_MIN_DIM} wide"
    return f"torch's BLAS (device.cpu_matmul={mode})"


def _stage_lines(run, stage: str, arch: M.Arch, s: M.Setup, cap: float | None) -> list[str]:
    """One stage's plan, whether it fits, and what to change when it does not."""
    if stage not in M.PLANNERS:
        raise RlhfError(f"doctor.stages: {stage} has no memory plan; choose from {', '.join(M.PLANNERS)}")
    plan = M.plan_stage(run, stage, arch, s)
    lines = M.format_plan(plan)
    if stage == "ppo" and s.strategy == "deepspeed":
        lines.append("    note: ppo runs under ddp or fsdp, not DeepSpeed; this plan is its ddp plan")
    lines.append(f"    -> {_verdict(plan, cap)}")
    if plan.offloaded:
        lines.append(f"    offloaded to CPU memory: {M.fmt_bytes(plan.offloaded)} per process")
    need = cap if cap is not None else (M.GiB * COMMON_GPU_GIB[1] if s.accelerator == "cuda" else None)
    if need is not None and plan.peak > need:
        label = "to fit" + (" a 24 GiB GPU" if cap is None else "")
        singles, combo = M.remedies(run, stage, arch, s, need)
        if singles:
            lines.append(f"    {label}, any of: " + "; ".join(f"{what} -> {M.fmt_bytes(p.peak)}"
                                                            for what, p in singles[:4]))
        elif combo:
            lines.append(f"    {label}, together: {combo[0]} -> {M.fmt_bytes(combo[1].peak)}")
        else:
            lines.append(f"    {label}: smaller micro-batches, activation checkpointing and ZeRO-3 "
                         "offload are not enough; shorten the sequences or use larger GPUs")
    return lines


def report(run) -> str:
    """The doctor's report for the run's settings `run` (rlhf_cli.settings.of)."""
    lines, dev = _machine_lines(run)
    try:
        arch, source = M.arch_for_model(run.model)
    except ValueError as e:
        raise RlhfError(str(e)) from None
    s = M.setup_from(run, len(dev["gpus"]), data_lengths(run))
    lines.append(f"model {run.model.name_or_path} (values from {source})")
    lines.append(f"  vocab {arch.vocab_size}, hidden {arch.hidden_size}, {arch.num_hidden_layers} layers, "
                 f"{arch.num_attention_heads} heads / {arch.num_key_value_heads} kv heads × {arch.head_dim}, "
                 f"intermediate {arch.intermediate_size}, {'tied' if arch.tie_word_embeddings else 'untied'} "
                 f"embeddings: {M.causal_lm_params(arch) / 1e6:.1f}M parameters "
                 f"({M.seq_cls_params(arch) / 1e6:.1f}M as a reward / value model)")
    where = f"{s.per_machine} process(es) per machine × {s.world // max(s.per_machine, 1)} machine(s)"
    zero = f", ZeRO-{s.zero_stage}" if s.zero_stage else ""
    lines.append(f"memory plan per process: device {run.device.name} ({s.strategy}{zero}), {where}")
    lines.append(f"  precision: frozen weights in {s.dtype_name} (model.dtype), compute {s.compute_name} "
                 "(device.mixed_precision); trainable weights, gradients and AdamW states in fp32")
    lines.append(f"  sequence lengths: {s.lengths.source}" if s.lengths.prompt is not None else
                 f"  sequence lengths: the configured maxima ({s.lengths.source})")
    cap, cap_src = _capacity(run, s, dev)
    lines.append(f"  against: {cap_src}")
    for stage in run.doctor.stages:
        lines += _stage_lines(run, str(stage), arch, s, cap)
    return "\n".join(lines)


def run(cfg) -> None:
    print(report(settings.of(cfg)))
