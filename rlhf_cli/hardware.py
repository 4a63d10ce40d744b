"""The process and the machine: thread count, seeds and library noise set first in every stage (`setup_torch`),
each CUDA process on its own GPU (`setup_cuda`), what the hardware computes natively (bf16 on the GPU or the CPU),
and the torch dtypes of a run's precision by the rule of rlhf_cli.precision."""

from __future__ import annotations

import logging
import os
import random
import sys
import warnings

import torch

from rlhf_cli.errors import RlhfError
from rlhf_cli.precision import autocast_dtype, precision, storage_dtype

# where bitsandbytes, and the kernels package it asks, report its lookup of an optional CPU kernel on a hub
KERNEL_HUB_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub")

log = logging.getLogger("rlhf")


def setup_torch(run) -> None:
    """Thread count and seeds from the run's settings (`run`: rlhf_cli.settings.of), first thing in every stage
    (two threads per process on a busy 2-core box can run 20x slower than one, so the count is explicit)."""
    if str(run.device.accelerator) == "cuda" and not torch.cuda.is_available():
        name = str(run.device.get("name") or "cuda")
        cpu = "cpu-ddp" if name == "ddp" else "cpu"
        raise RlhfError(f"device={name} needs a CUDA GPU, but torch sees none (torch {torch.__version__}); use "
                        f"device={cpu}, or install a CUDA build of torch")
    threads = int(run.device.get("threads") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    if str(run.device.accelerator) == "cuda":
        setup_cuda()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seed = int(run.seed)
    random.seed(seed)
    torch.manual_seed(seed)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    quiet_datasets()
    # library-internal notices a user cannot act on: peft reads a renamed transformers attribute, and warns about
    # a LoRA on a tied lm_head, which merge_lora and merged sampling handle (the embeddings stay as they are)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*", category=UserWarning)
    warnings.filterwarnings("ignore", message=".*save_embedding_layers.*", category=UserWarning)
    # bitsandbytes' int8 matmul says at every call that it computes in fp16, which is how LLM.int8() works
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt: inputs will be cast.*", category=UserWarning)
    # and, imported in a QLoRA run, that it could not fetch an optional CPU kernel from a hub (offline: that it
    # skipped the hub's trust check): it runs its own
    for name in KERNEL_HUB_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_datasets() -> None:
    """datasets without progress bars or notices: told directly where it is imported (sft, reward and dpo train on
    its Dataset), else by the variables it reads when imported, so that ppo, eval, chat and export, which need it
    only for a hub dataset, do not import it (and pandas and pyarrow with it) at every start. A user's own
    setting of either variable stands where datasets is not yet imported."""
    if "datasets" in sys.modules:
        logs = sys.modules["datasets"].utils.logging
        logs.disable_progress_bar()
        logs.set_verbosity_error()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("DATASETS_VERBOSITY", "error")


def setup_cuda() -> None:
    """Before anything touches the GPU: each launched process on its own GPU (LOCAL_RANK; otherwise every rank
    of a DDP sft/reward run would open a context on GPU 0 first), and an allocator that grows segments instead of
    keeping a cached block per shape (PPO's shapes change with every micro-batch's length). A setting the user
    made stays."""
    if not any(os.environ.get(v) for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")):
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and torch.cuda.device_count() > int(local_rank):
        torch.cuda.set_device(int(local_rank))


def cuda_bf16_native(accelerator: str) -> bool | None:
    """Whether the CUDA GPU computes bf16 natively (Ampere and later); None without a CUDA GPU. Pre-Ampere GPUs
    report bf16 support through emulation, which runs far slower than fp16: `auto` must not pick it there."""
    if accelerator != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # a torch without the argument
        return bool(torch.cuda.is_bf16_supported())


def resolve_dtype(name: str, accelerator: str) -> torch.dtype:
    """`model.dtype` as a torch dtype (the rule: rlhf_cli.precision.storage_dtype)."""
    cuda_bf16 = cuda_bf16_native(accelerator)
    return getattr(torch, storage_dtype(name, accelerator, cuda_bf16))


def resolve_compute_dtype(name: str | None, accelerator: str) -> torch.dtype | None:
    """`device.mixed_precision` -> the autocast dtype, or None for fp32 compute (rlhf_cli.precision)."""
    cuda_bf16 = cuda_bf16_native(accelerator)
    compute = autocast_dtype(name, accelerator, cuda_bf16)
    return None if compute is None else getattr(torch, compute)


def resolve_precision(run) -> tuple[torch.dtype, torch.dtype | None]:
    """(storage dtype of frozen weights from `model.dtype`, compute dtype from `device.mixed_precision`, None
    for fp32) of the run's settings (`run`: rlhf_cli.settings.of), by the rule of rlhf_cli.precision, with this
    machine's CUDA and CPU."""
    acc = str(run.device.accelerator)
    cuda_bf16 = cuda_bf16_native(acc)
    p = precision(run.model.dtype, run.device.get("mixed_precision"), acc, cuda_bf16=cuda_bf16,
                  cpu_bf16=cpu_bf16_native() if acc == "cpu" else None)
    if p.slow_cpu_bf16:
        cap = torch.backends.cpu.get_cpu_capability()
        _warn_once("cpu-bf16", f"bf16 on this CPU ({cap}, no AVX512-BF16 or AMX) runs its matmuls without "
                   "bf16 units, 49-98x slower than fp32 (make bench-real, one AVX2 core); for CPU runs set "
                   "model.dtype=float32 device.mixed_precision=no")
    return getattr(torch, p.storage), None if p.autocast is None else getattr(torch, p.autocast)


def cpu_flag(name: str) -> bool | None:
    """One of torch.cpu's feature probes (`_is_amx_tile_supported`, `_is_avx512_bf16_supported`, ...); None
    where this torch has no such probe or it cannot answer."""
    probe = getattr(torch.cpu, name, None)
    if not callable(probe):
        return None
    try:
        return bool(probe())
    except RuntimeError:
        return None


def cpu_bf16_native() -> bool | None:
    """Whether this CPU has bf16 matmul units torch uses (AVX512-BF16 or AMX tiles); None if torch cannot
    say."""
    flags = [cpu_flag(n) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return None if None in flags else any(flags)


_WARNED: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)
